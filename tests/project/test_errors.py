"""The exception hierarchy is one tree rooted at MpmdError."""

import pytest

import nnx_mpmd as mp
from nnx_mpmd import errors


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_derives_from_mpmd_error(name):
    cls = getattr(errors, name)
    assert issubclass(cls, mp.MpmdError)
    assert getattr(mp, name) is cls


def test_stage_number_must_be_a_non_negative_int():
    from flax import nnx

    with pytest.raises(mp.PartitionError, match=r"stage=-1.*Linear.*int >= 0"):
        mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=-1)
