"""Per-token log-probs (and entropy) of given token ids under megatron's pipeline schedule.

Sequences of different lengths are either right-padded into microbatches of one
common length (the pipeline's p2p buffers need one shape; causal attention keeps
padding from touching real tokens), or, with a token budget, packed several to a
row (`policy/packing.py`) so compute goes to real tokens. Log-probs are computed
vocab-parallel on the last pipeline stage, never gathering the full vocabulary,
and broadcast back to every pipeline stage so the ranks that own the data have
them. Losses always see per-sequence rows, packed or not.

Shapes: B sequences, T = longest length, V/tp = this rank's vocabulary shard.
`logp[b, t] = log p(tokens[b, t + 1] | tokens[b, : t + 1])`, so outputs are `[B, T - 1]`.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from moe_rl.data.balance import pack_bins
from moe_rl.dist.devices import compute_device
from moe_rl.policy import compat
from moe_rl.policy.packing import PackedRow, model_kwargs, pack_row, unpack


@dataclass
class Microbatch:
    """One microbatch as the schedule sees it.

    tokens: `[b, s]` right-padded token ids; lengths: `[b]`; index: `[b]` rows of the
    caller's batch (-1: an ignored row); extras: per-row tensors the loss needs
    (advantages `[b]`, old log-probs `[b, s - 1]`, ...), padded like `tokens`.
    packed: when set, the model runs on this packed row instead of `tokens`;
    everything else (and what losses see) stays per sequence.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    index: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    packed: PackedRow | None = None

    @property
    def model_tokens(self) -> torch.Tensor:
        """`[b_m, s_m]`: the token ids the model runs on (the packed row, or `tokens`)."""
        return self.tokens if self.packed is None else self.packed.tokens

    def placement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where sequence j sits in `model_tokens`: (row `[b]`, start position `[b]`)."""
        b = self.tokens.shape[0]
        if self.packed is None:
            return torch.arange(b), torch.zeros(b, dtype=torch.long)
        return torch.zeros(b, dtype=torch.long), self.packed.starts.cpu()

    @property
    def loss_mask(self) -> torch.Tensor:
        """`[b, s - 1]`: 1 where position t predicts a real token t + 1."""
        s = self.tokens.shape[1]
        pos = torch.arange(s - 1, device=self.lengths.device)
        return (pos.unsqueeze(0) < (self.lengths - 1).unsqueeze(1)).float()

    def to(self, device: torch.device) -> "Microbatch":
        return Microbatch(tokens=self.tokens.to(device), lengths=self.lengths.to(device),
                          index=self.index.to(device), extras={k: v.to(device) for k, v in self.extras.items()},
                          packed=None if self.packed is None else self.packed.to(device))


def pad_length(max_len: int, multiple: int) -> int:
    """Round up to a multiple (sequence parallel splits the sequence over TP ranks)."""
    return -(-max_len // multiple) * multiple


def make_microbatches(sequences: list[torch.Tensor], micro_batch_size: int, pad_multiple: int = 1,
                      extras: dict[str, torch.Tensor] | None = None, pad_id: int = 0,
                      seq_len: int | None = None, count_multiple: int | None = None) -> list[Microbatch]:
    """Split sequences (each `[T_i]`) into right-padded microbatches of one common length.

    `extras` tensors are indexed by row (first dim B) and sliced along with tokens.
    `count_multiple`: make the number of microbatches a multiple of it by adding
    microbatches of ignored rows (default: what this rank's pipeline schedule needs).
    """
    if not sequences:
        raise ValueError("no sequences to process")
    lengths = torch.tensor([s.shape[0] for s in sequences])
    if int(lengths.min()) < 2:
        raise ValueError("every sequence needs at least 2 tokens (a prompt token and one to score)")
    s = pad_length(seq_len or int(lengths.max()), pad_multiple)
    tokens = torch.full((len(sequences), s), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        tokens[i, : seq.shape[0]] = seq
    out = []
    for start in range(0, len(sequences), micro_batch_size):
        idx = torch.arange(start, min(start + micro_batch_size, len(sequences)))
        ex = {k: v[idx] for k, v in (extras or {}).items()}
        out.append(Microbatch(tokens=tokens[idx], lengths=lengths[idx], index=idx, extras=ex))
    if len(out) > 1 and out[-1].tokens.shape[0] < micro_batch_size:
        # The schedule's p2p buffers use one shape: fill the last microbatch with
        # copies of a row marked `index = -1`, which losses and outputs ignore.
        out[-1] = _pad_microbatch(out[-1], micro_batch_size)
    multiple = schedule_multiple() if count_multiple is None else count_multiple
    while len(out) % multiple:
        out.append(_ignored_microbatch(out[0]))
    return out


def schedule_multiple() -> int:
    """Microbatch count the pipeline schedule needs a multiple of: PP size under VPP, else 1.

    megatron's interleaved (VPP) schedule refuses counts that leave a partial round.
    """
    if not dist.is_initialized():
        return 1
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_world_size() if vpp and vpp > 1 else 1


def _ignored_microbatch(like: Microbatch) -> Microbatch:
    """A microbatch of `like`'s shape whose rows are all ignored (`index = -1`)."""
    return Microbatch(tokens=like.tokens.clone(), lengths=like.lengths.clone(),
                      index=torch.full_like(like.index, -1), extras={k: v.clone() for k, v in like.extras.items()},
                      packed=like.packed)


def packed_format(chunks: list[Any]) -> str:
    """How packed rows keep sequences apart: "thd" under transformer-engine, else "mask".

    transformer-engine runs THD (varlen) attention only in fp16/bf16 (its unfused
    fp32 attention has no THD path), so fp32 models under TE cannot pack.
    """
    from moe_rl.policy.perf import use_transformer_engine

    if not use_transformer_engine():
        return "mask"
    if chunks and chunks[0].config.params_dtype == torch.float32:
        raise ValueError("packed micro-batches under transformer-engine need model.dtype bf16 or fp16 (TE has no "
                         "fp32 varlen attention); use bf16, or set parallel.max_tokens_per_microbatch=null")
    return "thd"


def make_packed_microbatches(sequences: list[torch.Tensor], max_tokens: int, pad_multiple: int = 1,
                             extras: dict[str, torch.Tensor] | None = None, pad_id: int = 0,
                             fmt: str = "mask", group_size: int = 1) -> list[Microbatch]:
    """Pack sequences into microbatches of one row each, holding at most `max_tokens` tokens.

    `group_size`: consecutive sequences that stay in one row, in order (DPO's chosen and
    rejected of a pair: group_size 2).

    Rows are padded to one common length (the fullest row, rounded up to `pad_multiple`).

    Every rank of the job ends up with the same row length and microbatch count
    (pipeline p2p buffers and expert-parallel exchanges need both), padding with
    ignored microbatches where a rank has fewer; so DP ranks may hold different
    numbers of sequences. `extras` as in `make_microbatches`.
    """
    if not sequences:
        raise ValueError("no sequences to process")
    lengths = [s.shape[0] for s in sequences]
    if min(lengths) < 2:
        raise ValueError("every sequence needs at least 2 tokens (a prompt token and one to score)")
    k = group_size
    bins = [[g * k + j for g in b for j in range(k)]
            for b in pack_bins([sum(lengths[i: i + k]) for i in range(0, len(lengths), k)], max_tokens)]
    fill = max(sum(lengths[i] for i in b) for b in bins)
    fill, count = _agree_max(pad_length(fill, pad_multiple), len(bins))
    out = []
    for b in bins:
        idx = torch.tensor(b)
        width = max(lengths[i] for i in b)
        tokens = torch.full((len(b), width), pad_id, dtype=torch.long)
        for j, i in enumerate(b):
            tokens[j, : lengths[i]] = sequences[i]
        ex = {k: (v[idx][:, : width - 1] if v.dim() > 1 else v[idx]) for k, v in (extras or {}).items()}
        out.append(Microbatch(tokens=tokens, lengths=torch.tensor([lengths[i] for i in b]), index=idx, extras=ex,
                              packed=pack_row([sequences[i] for i in b], fill, fmt, pad_id)))
    multiple = schedule_multiple()
    while len(out) < count or len(out) % multiple:
        out.append(_ignored_microbatch(out[0]))
    return out


def _agree_max(*values: int) -> tuple[int, ...]:
    """Element-wise maximum of small integers over all ranks."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.long, device=compute_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in t.tolist())


def build_microbatches(sequences: list[torch.Tensor], micro_batch_size: int, max_tokens: int | None = None,
                       extras: dict[str, torch.Tensor] | None = None, seq_len: int | None = None,
                       chunks: list[Any] | None = None, group_size: int = 1) -> list[Microbatch]:
    """This rank's microbatches: packed by token budget when `max_tokens` is set, else padded rows.

    Collective: every rank calls it. Padded rows need equal sequence counts on DP
    ranks; packing does not. `seq_len`: pad rows to at least this (padded rows only);
    `chunks`: the model the microbatches are for, which decides how packed rows keep
    sequences apart (`packed_format`). `group_size`: each run of that many consecutive
    sequences lands in one microbatch, in order (a loss over pairs needs both).
    """
    if len(sequences) % group_size or (max_tokens is None and micro_batch_size % group_size):
        raise ValueError(f"{len(sequences)} sequences in micro-batches of {micro_batch_size} cannot keep groups of "
                         f"{group_size} together; use a multiple of {group_size} (parallel.micro_batch_size)")
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    longest = max(x.shape[0] for x in sequences) if sequences else 0
    if max_tokens:
        extras = {k: fit_width(v, longest - 1) for k, v in (extras or {}).items()}
        return make_packed_microbatches(sequences, max_tokens, pad_multiple=tp, extras=extras,
                                        fmt=packed_format(chunks or []), group_size=group_size)
    seq_len = pad_length(agree_on_shape(len(sequences), max(seq_len or 0, longest)), tp)
    extras = {k: fit_width(v, seq_len - 1) for k, v in (extras or {}).items()}
    return make_microbatches(sequences, micro_batch_size, pad_multiple=tp, seq_len=seq_len, extras=extras)


def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad or cut a per-token extra `[B, T']` to `[B, width]`; per-sequence extras `[B]` pass through."""
    if t.dim() < 2:
        return t
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel log p of the next token. logits `[b, s, V/tp]`, tokens `[b, s]` -> `[b, s - 1]`.

    Differentiable. `vocab_parallel_cross_entropy` rewrites its input in place, so it
    gets its own fp32 copy.
    """
    from megatron.core import tensor_parallel

    shifted = logits[:, :-1].float().contiguous()
    return -tensor_parallel.vocab_parallel_cross_entropy(shifted.clone(), tokens[:, 1:].contiguous())


def microbatch_logprobs(logits: torch.Tensor, mb: Microbatch, temperature: float = 1.0) -> torch.Tensor:
    """`[b, s - 1]` per-sequence log-probs from the model's logits `[b_m, s_m, V/tp]` (packed or not).

    With `temperature` T the log-probs are log_softmax(logits / T): the distribution the
    rollout engine sampled from (and returned log-probs of), so trainer and engine agree.
    """
    logits = tempered(logits, temperature)
    if mb.packed is None:
        return token_logprobs(logits, mb.tokens)
    flat = token_logprobs(logits, mb.packed.tokens)[0]
    return unpack(flat, mb.packed.starts, mb.tokens.shape[1] - 1) * mb.loss_mask


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / T` in fp32 (a new tensor; the logits themselves are left as they are)."""
    return logits if temperature == 1.0 else logits.float() / temperature


def microbatch_entropy(logits: torch.Tensor, mb: Microbatch, temperature: float = 1.0) -> torch.Tensor:
    """`[b, s - 1]` per-sequence next-token entropy of softmax(logits / T) (packed or not)."""
    logits = tempered(logits, temperature)
    if mb.packed is None:
        return token_entropy(logits)
    return unpack(token_entropy(logits)[0], mb.packed.starts, mb.tokens.shape[1] - 1) * mb.loss_mask


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel entropy of the next-token distribution: `[b, s, V/tp]` -> `[b, s - 1]`."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    x = logits[:, :-1].float()
    m = x.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m.unsqueeze(-1))
    z = e.sum(-1)
    ez = (e * x).sum(-1)
    dist.all_reduce(z, group=group)
    dist.all_reduce(ez, group=group)
    # H = log Z - E_p[x], with Z and x shifted by m.
    return torch.log(z) + m - ez / z


# A loss function runs on the last stage: (logits [b, s, V/tp], microbatch) ->
# (scalar loss to backpropagate, dict of outputs to keep).
LossFn = Callable[[torch.Tensor, Microbatch], tuple[torch.Tensor, dict[str, Any]]]

# Per-token outputs `[b, s - 1]` of one microbatch from the model's output (log-probs, values).
PerToken = Callable[[torch.Tensor, Microbatch], torch.Tensor]

# Routing around a schedule run: given the microbatches, a context manager to run
# the schedule in (`RouteReplay.record` / `RouteReplay.replay` bound to their routes).
# A context that yields an object with `.routes` hands recorded routes back.
Routing = Callable[[list[Microbatch]], AbstractContextManager]


def run_schedule(chunks: list[Any], microbatches: list[Microbatch], loss_fn: LossFn,
                 forward_only: bool) -> list[dict[str, Any]]:
    """Run megatron's pipeline schedule over `microbatches`; return loss_fn outputs (last stage only).

    Every rank of a model-parallel group must pass the same microbatches. Losses are
    summed, not averaged, over microbatches (`calculate_per_token_loss`): callers
    normalise with global counts so gradients add up across microbatches and DP ranks.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[Microbatch], model: Any):
        mb = next(data_iterator).to(compute_device())
        with compat.native():  # the forward and the loss name no CUDA device (the schedule does)
            if mb.packed is not None:
                output = model(mb.packed.tokens, mb.packed.positions, **model_kwargs(mb.packed))
            else:
                pos = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
                output = model(mb.tokens, pos, attention_mask=None)

        def loss_func(logits: torch.Tensor):
            with compat.native():
                loss, out = loss_fn(logits, mb)
            return loss, torch.ones((), dtype=torch.int), out

        return output, loss_func

    mbs, seq_len = microbatches[0].model_tokens.shape
    if any(mb.model_tokens.shape != (mbs, seq_len) for mb in microbatches):
        raise ValueError("all microbatches must share one sequence length and size (see build_microbatches)")
    iters = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_len,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


def _pad_microbatch(mb: Microbatch, size: int) -> Microbatch:
    extra_rows = size - mb.tokens.shape[0]
    rep = torch.zeros(extra_rows, dtype=torch.long)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[rep]], dim=0)

    return Microbatch(tokens=pad(mb.tokens), lengths=pad(mb.lengths),
                      index=torch.cat([mb.index, torch.full((extra_rows,), -1, dtype=mb.index.dtype)]),
                      extras={k: pad(v) for k, v in mb.extras.items()})


def agree_on_shape(num_sequences: int, seq_len: int) -> int:
    """Common padded length across all ranks; checks every DP rank has as many sequences.

    Expert-parallel token exchange and DP-replicated pipelines run collectives per
    microbatch, so every rank must run the same number of microbatches of one shape.
    """
    if not dist.is_initialized():
        return seq_len
    t = torch.tensor([seq_len, num_sequences, -num_sequences], dtype=torch.long, device=compute_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[1]) != -int(t[2]):
        raise ValueError(f"data-parallel ranks hold different numbers of sequences (between {-int(t[2])} and "
                         f"{int(t[1])}); shard the batch evenly across data-parallel ranks")
    return int(t[0])


@dataclass
class LogProbs:
    """Per-token results for B sequences, aligned with the input order.

    logp, entropy: `[B, T - 1]` (0 past each sequence's end); mask: `[B, T - 1]`.
    """

    logp: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [B, T - 1, L, K] when recorded
    route_confidence: torch.Tensor | None = None  # [B, T - 1, L, 2] (gate mass, logit margin) when asked


@torch.no_grad()
def compute_logprobs(chunks: list[Any], sequences: list[torch.Tensor], micro_batch_size: int,
                     with_entropy: bool = False, seq_len: int | None = None,
                     routing: Routing | None = None, max_tokens: int | None = None,
                     temperature: float = 1.0, per_token: PerToken | None = None) -> LogProbs:
    """Log-probs (and entropy) of each sequence's tokens, on every rank of the model-parallel group.

    Both are of softmax(logits / `temperature`), the distribution the rollout engine samples from.

    `routing` wraps the schedule run, e.g. to record routes (R2) or replay given ones (R3).
    `max_tokens`: pack sequences into rows of this many tokens instead of padding.
    `per_token`: what `logp` holds, from the model's output per microbatch (default
    `microbatch_logprobs` at `temperature`; the critic passes its values, `critic.microbatch_values`).
    """
    per_token = per_token or (lambda logits, mb: microbatch_logprobs(logits, mb, temperature))
    from megatron.core import parallel_state as ps

    for c in chunks:
        c.eval()
    mbs = build_microbatches(sequences, micro_batch_size, max_tokens, seq_len=seq_len, chunks=chunks)

    def keep(logits: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, dict[str, Any]]:
        out = {"index": mb.index, "logp": per_token(logits, mb)}
        if with_entropy:
            out["entropy"] = microbatch_entropy(logits, mb, temperature)
        return logits.new_zeros(()), out

    with (routing(mbs) if routing else nullcontext()) as recording:
        outputs = run_schedule(chunks, mbs, keep, forward_only=True)
    s = max(mb.tokens.shape[1] for mb in mbs)
    n = len(sequences)
    logp = torch.zeros(n, s - 1)
    ent = torch.zeros(n, s - 1) if with_entropy else None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for out in outputs:
            index = out["index"].cpu()
            rows = index >= 0
            w = out["logp"].shape[1]
            logp[index[rows], :w] = out["logp"].float().cpu()[rows]
            if ent is not None:
                ent[index[rows], :w] = out["entropy"].float().cpu()[rows]
    _broadcast_from_last_stage(logp)
    if ent is not None:
        _broadcast_from_last_stage(ent)
    lengths = torch.tensor([x.shape[0] for x in sequences])
    mask = (torch.arange(s - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)).float()
    return LogProbs(logp=logp * mask, mask=mask, entropy=None if ent is None else ent * mask,
                    routes=getattr(recording, "routes", None),
                    route_confidence=getattr(recording, "confidence", None))


def _broadcast_from_last_stage(t: torch.Tensor) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return
    buf = t.to(compute_device())
    dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    t.copy_(buf.cpu())
