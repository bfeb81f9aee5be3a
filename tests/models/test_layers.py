"""The packed linear's row bucketing: bounded shapes for oneDNN, the same rows out."""

from __future__ import annotations

import pytest
import torch

from radixgen.models.layers import Linear, padded_rows


def test_prefill_lengths_map_to_few_row_counts_with_little_padding() -> None:
    lengths = range(65, 4097)
    padded = [padded_rows(n) for n in lengths]
    assert all(p >= n for p, n in zip(padded, lengths, strict=True))
    assert max(p / n for p, n in zip(padded, lengths, strict=True)) <= 1.0625
    assert len(set(padded)) <= 100, "each distinct row count is a oneDNN primitive kept in memory"
    assert [padded_rows(n) for n in range(1, 65)] == list(range(1, 65)), "decode batches run exact"


@pytest.mark.parametrize("rows", [1, 64, 65, 300, 1000])
def test_padded_rows_give_the_unpadded_result(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=True, dtype=torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()  # type: ignore[union-attr]
    layer.pack()
    x = torch.randn(rows, 96)
    got = layer(x)
    assert got.shape == (rows, 80)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
