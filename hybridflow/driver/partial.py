"""Partial rollouts (``rollout.partial``): responses that outlive the weights that started them.

Without them a batch's generation lasts as long as its longest response, and the replicas idle
while the last few sequences decode. With them the generation pool keeps ``train_batch_size``
groups (a prompt and its ``n`` samples) in progress and extends every unfinished response by at
most ``rollout.partial_tokens`` tokens a chunk (one ``RolloutWorker.extend`` call, each response a
request continuing from its prompt and the tokens it has); between chunks the finished groups
leave and fresh prompts take their places. A round (the pool's work during one training step)
ends as soon as a batch's worth of groups is done: the responses still going are kept, and the
next round continues them under the weights pushed in between.

So one response may hold tokens of several weight versions. Each token keeps the version it was
sampled with and its behaviour log-prob (``token_version``, ``rollout_logprobs``), which is what
``actor.rollout_correction`` corrects per token. A group whose oldest token would be more than
``rollout.max_staleness`` updates behind the trainer when trained is dropped, and counted, at the
start of the round it would be trained after (``rollout/dropped``).

Everything here is decided by the prompts drawn, the round's versions and the replicas' seeded
draws: ``state_dict`` holds the groups in progress and finished, and the prompts drawn but not
started, so a resumed run continues them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Extend = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float], bool, int]]]
"""Extend responses on the generation pool: (prefixes, most tokens each) -> per request
(tokens, log-probs, whether it stopped, the weight version), in request order."""


@dataclass
class Response:
    """One sample in progress: its tokens so far, their log-probs and weight versions, and why
    it ended (None while it goes on)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass
class Group:
    """A prompt (its index into the training items) and its ``n`` responses."""

    prompt: int
    responses: list[Response]

    @property
    def done(self) -> bool:
        return all(r.finish is not None for r in self.responses)

    @property
    def oldest(self) -> int | None:
        """The oldest weight version of any of its tokens; None before it has any."""
        return min((r.versions[0] for r in self.responses if r.versions), default=None)


class PartialRollouts:
    """The groups in progress between rounds; ``round`` makes each batch's groups."""

    def __init__(self, groups: int, n: int, chunk: int, max_tokens: int, bound: int):
        self.groups, self.n, self.chunk = groups, n, chunk
        self.max_tokens, self.bound = max_tokens, bound
        self.active: list[Group] = []
        """Groups in progress, in the order they started."""
        self.finished: list[Group] = []
        """Groups done beyond the last batch's count: the next batch's first."""
        self.pending: list[int] = []
        """Prompts drawn from the sampler and not started yet."""

    def round(self, trained_at: int, prompt_ids: Callable[[int], list[int]],
              draw: Callable[[], list[int]], extend: Extend) -> tuple[list[Group], dict]:
        """The next batch's ``groups`` finished groups, to be trained on by weights of version
        ``trained_at``; ``prompt_ids(i)`` is prompt i's tokens, ``draw()`` the sampler's next
        prompts, ``extend`` the generation pool. Also its metrics: the samples dropped as too
        stale, the chunks run, and the responses carried into the next round."""
        dropped = self._drop_stale(trained_at)
        chunks, out = 0, self.finished
        while len(out) < self.groups:
            while len(self.active) < self.groups:
                if not self.pending:
                    self.pending = list(draw())
                self.active.append(Group(self.pending.pop(0),
                                         [Response() for _ in range(self.n)]))
            going = [(g, r) for g in self.active for r in g.responses if r.finish is None]
            results = extend([prompt_ids(g.prompt) + r.ids for g, r in going],
                             [min(self.chunk, self.max_tokens - len(r.ids)) for _, r in going])
            for (_, r), (ids, logprobs, stopped, version) in zip(going, results, strict=True):
                r.ids += ids
                r.logprobs += logprobs
                r.versions += [version] * len(ids)
                if stopped:
                    r.finish = "stop"
                elif len(r.ids) >= self.max_tokens:
                    r.finish = "length"
            chunks += 1
            out = out + [g for g in self.active if g.done]
            self.active = [g for g in self.active if not g.done]
        batch, self.finished = out[:self.groups], out[self.groups:]
        carried = sum(r.finish is None for g in self.active for r in g.responses)
        return batch, {"rollout/dropped": float(dropped), "rollout/chunks": float(chunks),
                       "rollout/carried": float(carried)}

    def _drop_stale(self, trained_at: int) -> int:
        """Drop the groups whose oldest token would be more than ``bound`` updates behind
        ``trained_at``; the samples dropped."""
        def fresh(g: Group) -> bool:
            return g.oldest is None or trained_at - g.oldest <= self.bound
        before = len(self.finished) + len(self.active)
        self.finished = [g for g in self.finished if fresh(g)]
        self.active = [g for g in self.active if fresh(g)]
        return (before - len(self.finished) - len(self.active)) * self.n

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Lists of numbers and strings only (loaded weights_only)."""
        def groups(gs: list[Group]) -> list[dict[str, Any]]:
            return [{"prompt": g.prompt, "responses": [
                {"ids": r.ids, "logprobs": r.logprobs, "versions": r.versions,
                 "finish": r.finish or ""} for r in g.responses]} for g in gs]
        return {"active": groups(self.active), "finished": groups(self.finished),
                "pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def groups(gs: list[dict[str, Any]]) -> list[Group]:
            return [Group(int(g["prompt"]), [
                Response(list(r["ids"]), list(r["logprobs"]), list(r["versions"]),
                         r["finish"] or None) for r in g["responses"]]) for g in gs]
        self.active, self.finished = groups(state["active"]), groups(state["finished"])
        self.pending = [int(i) for i in state["pending"]]
