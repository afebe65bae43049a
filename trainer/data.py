"""Synthetic, deterministic training data and the sampler that shards it across DP ranks.

The corpus is text from a fixed random Markov chain: each token has a few possible successors with
skewed probabilities. A model can learn the table, so the loss falls from log(vocab) towards the
chain's entropy (`SyntheticCorpus.entropy`), a floor no model can beat. Sequence i is generated
from (seed, i) alone, so any rank can produce any sequence without a dataset on disk.
"""

from __future__ import annotations

import torch

BRANCHING = 4  # successors per token


class SyntheticCorpus:
    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        branching = min(BRANCHING, vocab_size)
        self.successors = _distinct_successors(vocab_size, branching, seed)
        weights = 1.0 / torch.arange(1, branching + 1, dtype=torch.float64)  # Zipf-like: one likely successor
        self.probs = weights / weights.sum()

    @property
    def entropy(self) -> float:
        """Lowest achievable mean loss in nats: every target is drawn from the chain given its input."""
        return -(self.probs * self.probs.log()).sum().item()

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both [len(indices), seq_len] int64."""
        first, choices = [], []
        for index in indices:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            first.append(torch.randint(self.vocab_size, (1,), generator=generator))
            choices.append(torch.multinomial(self.probs, self.seq_len, replacement=True, generator=generator))
        tokens = [torch.cat(first)]
        choice = torch.stack(choices)
        for t in range(self.seq_len):
            tokens.append(self.successors[tokens[-1], choice[:, t]])
        sequence = torch.stack(tokens, dim=1)
        return sequence[:, :-1], sequence[:, 1:]


def _distinct_successors(vocab_size: int, branching: int, seed: int) -> torch.Tensor:
    """[vocab_size, branching] int64: for every token, ``branching`` distinct successors drawn uniformly.

    Drawn as random integers, redrawing only the rows that came out with a repeat (about 6 rows in V for 4
    successors), so the table costs O(V·branching): a full permutation of the vocabulary per token is O(V²) work,
    minutes and gigabytes at a realistic vocabulary of 32,768."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randint(vocab_size, (vocab_size, branching), generator=generator)
    while True:
        ordered = table.sort(dim=1).values
        repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1).nonzero().flatten()
        if repeats.numel() == 0:
            return table
        table[repeats] = torch.randint(vocab_size, (repeats.numel(), branching), generator=generator)


class DistributedSampler:
    """Which sequences this DP rank trains on at each step.

    Sequence positions run on forever; epoch e visits the corpus in a permutation seeded by (seed, e).
    Step s uses positions [s·B, (s+1)·B) for global batch B, and DP rank r takes the r-th contiguous
    slice. Every layout with the same seed and global batch therefore trains on the same sequences
    per step, no two DP ranks read the same one, and `consumed` is the whole data position.
    """

    def __init__(
        self, corpus_size: int, global_batch: int, dp_rank: int, dp_size: int, seed: int) -> None:
        self.corpus_size, self.global_batch, self.seed = corpus_size, global_batch, seed
        self.per_rank = global_batch // dp_size
        self.offset = dp_rank * self.per_rank  # where this rank's slice of a global batch starts
        self.consumed = 0
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _index(self, position: int) -> int:
        epoch, within = divmod(position, self.corpus_size)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.corpus_size, generator=generator)
        return int(self._order[within])

    def next_indices(self) -> list[int]:
        start = self.consumed + self.offset
        self.consumed += self.global_batch
        return [self._index(position) for position in range(start, start + self.per_rank)]

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = state["consumed"]
