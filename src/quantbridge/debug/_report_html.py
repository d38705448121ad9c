def render_html(compare=None, sensitivity=None) -> str:
    return ""
