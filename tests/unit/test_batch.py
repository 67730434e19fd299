import pytest
import torch

from hybridflow.batch import Batch


def test_split_concat_round_trip_and_meta():
    b = Batch({"x": torch.arange(6).view(6, 1)}, {"s": list("abcdef")}, {"step": 3})
    parts = b.split(3)
    assert [p["s"] for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(p.meta == {"step": 3} for p in parts)
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["s"] == b["s"]


def test_index_update_and_mismatched_sizes():
    b = Batch({"x": torch.arange(4)}, {"s": list("abcd")})
    assert b.index([3, 0])["s"] == ["d", "a"]
    assert torch.equal(b.update(Batch({"y": torch.ones(4)}))["y"], torch.ones(4))
    with pytest.raises(ValueError, match="disagree"):
        Batch({"x": torch.arange(4)}, {"s": list("abc")})
    with pytest.raises(ValueError, match="multiple of 3"):
        b.split(3)
