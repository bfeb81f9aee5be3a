"""Prefix cache: a radix tree over token ids whose values are KV slots."""

from radixgen.radix.tree import MatchResult, RadixTree

__all__ = ["MatchResult", "RadixTree"]
