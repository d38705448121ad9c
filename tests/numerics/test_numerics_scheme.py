"""QScheme / granularity validation, integer grids, serialisation, storage dtypes."""

import json

import numpy as np
import pytest

from quantbridge.numerics import (
    PerChannel,
    PerTensor,
    QScheme,
    granularity_from_dict,
    normalize_axis,
    storage_dtype,
)

# (bits, signed, narrow_range) -> (qmin, qmax), written out by hand.
GRIDS = {
    (2, True, False): (-2, 1),
    (2, True, True): (-1, 1),
    (2, False, False): (0, 3),
    (2, False, True): (0, 2),
    (4, True, False): (-8, 7),
    (4, True, True): (-7, 7),
    (4, False, False): (0, 15),
    (4, False, True): (0, 14),
    (8, True, False): (-128, 127),
    (8, True, True): (-127, 127),
    (8, False, False): (0, 255),
    (8, False, True): (0, 254),
    (16, True, False): (-32768, 32767),
    (16, True, True): (-32767, 32767),
    (16, False, False): (0, 65535),
    (16, False, True): (0, 65534),
}


@pytest.mark.parametrize(("key", "grid"), GRIDS.items(), ids=str)
def test_grid_golden(key, grid):
    bits, signed, narrow = key
    scheme = QScheme(bits=bits, signed=signed, narrow_range=narrow)
    assert (scheme.qmin, scheme.qmax) == grid


@pytest.mark.parametrize("bits", range(2, 17))
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("narrow", [True, False])
def test_every_bit_width_has_a_grid_that_fits_its_storage(bits, signed, narrow):
    scheme = QScheme(bits=bits, signed=signed, narrow_range=narrow)
    assert scheme.qmax - scheme.qmin + 1 == 2**bits - (1 if narrow else 0)
    info = np.iinfo(storage_dtype(scheme))
    assert info.min <= scheme.qmin and scheme.qmax <= info.max
    assert storage_dtype(scheme).itemsize == (1 if bits <= 8 else 2)


def test_storage_dtype_golden():
    assert storage_dtype(QScheme()) == np.int8
    assert storage_dtype(QScheme(signed=False)) == np.uint8
    assert storage_dtype(QScheme(bits=4)) == np.int8
    assert storage_dtype(QScheme(bits=9, signed=False)) == np.uint16
    assert storage_dtype(QScheme(bits=16)) == np.int16


@pytest.mark.parametrize("bits", [0, 1, 17, 32, -8])
def test_bits_out_of_range_names_value_and_range(bits):
    with pytest.raises(ValueError, match=rf"bits={bits}.*2\.\.16"):
        QScheme(bits=bits)


@pytest.mark.parametrize("bits", [8.0, True, "8"])
def test_bits_must_be_int(bits):
    with pytest.raises(TypeError, match="bits"):
        QScheme(bits=bits)


def test_bad_scale_constraint():
    with pytest.raises(ValueError, match="'pow3'.*float.*pow2"):
        QScheme(scale_constraint="pow3")


@pytest.mark.parametrize("name", ["signed", "symmetric", "narrow_range"])
def test_flags_must_be_bool(name):
    with pytest.raises(TypeError, match=name):
        QScheme(**{name: 1})


def test_granularity_type_checked():
    with pytest.raises(TypeError, match="granularity"):
        QScheme(granularity="per_tensor")
    with pytest.raises(TypeError, match="axis"):
        PerChannel(axis=1.0)


def test_symmetric_unsigned_is_allowed():
    scheme = QScheme(signed=False, symmetric=True)
    assert (scheme.qmin, scheme.qmax) == (0, 255)


@pytest.mark.parametrize(
    "scheme",
    [
        QScheme(),
        QScheme(bits=4, signed=False, symmetric=False, narrow_range=True),
        QScheme(granularity=PerChannel(axis=-1), scale_constraint="pow2"),
    ],
)
def test_dict_round_trip_through_json(scheme):
    d = json.loads(json.dumps(scheme.to_dict()))
    assert QScheme.from_dict(d) == scheme


def test_from_dict_defaults_and_unknown_keys():
    assert QScheme.from_dict({}) == QScheme()
    with pytest.raises(ValueError, match="'reduce_range'"):
        QScheme.from_dict({"bits": 8, "reduce_range": True})
    with pytest.raises(ValueError, match="'block'"):
        QScheme.from_dict({"granularity": {"kind": "per_channel", "axis": 0, "block": 32}})
    with pytest.raises(ValueError, match="per_block"):
        granularity_from_dict({"kind": "per_block"})
    with pytest.raises(ValueError, match="bits=1"):
        QScheme.from_dict({"bits": 1})


def test_granularity_round_trip_and_axis():
    assert granularity_from_dict(PerTensor().to_dict()) == PerTensor()
    assert granularity_from_dict(PerChannel(-1).to_dict()) == PerChannel(-1)
    assert PerChannel(-1).resolve_axis(4) == 3
    assert normalize_axis(-4, 4) == 0
    with pytest.raises(ValueError, match="axis 2 is out of range.*rank 2"):
        PerChannel(2).resolve_axis(2)


def test_schemes_are_frozen_and_hashable():
    scheme = QScheme()
    with pytest.raises(AttributeError):
        scheme.bits = 4
    assert len({QScheme(), QScheme(), QScheme(bits=4)}) == 2
