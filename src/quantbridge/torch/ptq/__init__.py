"""Post-training accuracy methods on the captured model, one module per method; each is switched
on by a ``Recipe`` field and wired into ``quantize`` by ``torch._quantize``."""
