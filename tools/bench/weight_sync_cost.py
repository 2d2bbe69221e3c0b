"""Cost model of one weight push, trainer -> SGLang servers, at cluster scale: full and delta, two paths.

An estimate, not a measurement: nothing is run (no GPU, no torch; yaml, and numpy for the fit).

- funnel (the old path, rollout/weight_sync/funnel.py): every trainer rank that owns HF tensors sends
  them to global rank 0, one point-to-point message per tensor; rank 0 broadcasts the whole model
  bucket by bucket (one flattened uint8 tensor per bucket) in one process group of rank 0 and every
  server's TP ranks. Per server: /begin_weight_update, a POST per bucket, /end_weight_update.
- sources (the new path, rollout/weight_sync/nccl.py): one dense source per pipeline stage (tp_rank 0,
  dp_rank 0; it TP-gathers first) and one expert source per (stage, EP rank) (edp_rank 0, etp_rank 0;
  it ETP-gathers first when etp > 1); the stage's first rank is both. Each source has one process
  group per server (the source + that server's TP ranks) and broadcasts its share bucket by bucket on
  each, to all servers at once, one HTTP POST per bucket per server. Per server also: begin, rank 0's
  last word (one small bucket carrying the version), end, and a verification call (checksums per
  tensor, compared with the sources'); a delta push first asks each server which version it holds.

Both: every server TP rank receives the full HF tensors (SGLang's protocol). Delta: a fraction `f` of
the bf16 values changed, spread evenly; each tensor goes as an int32 index + bf16 value per changed
element (6 f bytes per element) or whole (2), whichever is smaller, as moe-rl serve takes it
(`--delta-encoding tensor`: changed tensors whole, all SGLang takes; with f spread evenly nearly every
tensor changes, so that delta costs a full push). The funnel has no delta of its own; its delta rows
are each rank diffing its share before sending it to rank 0.

The tensor inventory is built from the model's HF config (the published config.json fields, `MODELS`):
embeddings, attention (GQA for Qwen3-MoE, multi-latent attention for DeepSeek-V3), router, shared
and routed experts, norms, lm_head, in bf16, placed as megatron places them: layers over the pipeline
stages (evenly, or `first_stage_layers` / `last_stage_layers`), the embedding on the first stage,
the final norm and lm_head on the last, expert e of a layer on EP rank e // (experts / ep); megatron
orders ranks tp (or etp, ep) fastest and pp slowest, 8 to a node. The trainer layouts (tp, pp, ep, etp,
uneven stages) and servers (num_servers, tp_size) are read from the shipped configs in launch/configs/;
the trainer world size is `train.world_size` where a config sets it, else the smallest the layout fits,
pp * lcm(tp, ep * etp) (what the configs' comments give: 32, 128, 512 GPUs).

Time of a push = max over links of bytes / bandwidth + the latencies that are serialized, with the
assumptions of `Assumptions` (printed with the table). The links:

- rank 0 (funnel) / the busiest source: NIC out, NIC in, NVLink (TP gathers, and in the funnel the
  shares of the ranks on rank 0's node). A broadcast is a ring: its root sends the bytes once.
- server NIC in: SGLang takes one weight update at a time per server (its tokenizer manager holds
  `model_update_lock`, or the pause condition, for each), so a server's buckets arrive one after
  another, each at one source's NIC rate, however many sources there are (`--concurrent-server-updates`
  assumes a server taking its sources' buckets at once, through as many of its GPUs' NICs);
- server NVLink (each server TP rank receives the full tensors through the ring) and HBM (checksums).

Serialized latencies: funnel: rank 0's point-to-point receives (one per tensor), an HTTP round trip
and a broadcast launch per bucket, rank 0's TP gathers; sources: per server an HTTP round trip and
a launch per bucket of every source (the server's lock serializes them), or the busiest source's
gathers and S launches per bucket, whichever chain is longer; and the fixed round trips (begin, end,
...). Trainer-internal control messages (rank 0's decisions, error gathering) are not counted.

Fit (`--json FILE`): rows measured on CPU by the scale benchmark (a list of dicts, or {"rows": [...]},
with path, mode, ranks, layout, experts, model_bytes, busiest_rank_bytes, messages_per_push, buckets,
push_s, peak_rss_mb, delta_bytes, verified; unverified rows are left out): push_s = a + b *
busiest_rank_bytes + c * messages_per_push by least squares per path, R^2, the log-log slopes of
busiest_rank_bytes and push_s against model_bytes and ranks, then the same formula with the GPU
assumptions at the flagship shapes.

    python tools/bench/weight_sync_cost.py                   # the cluster estimate
    python tools/bench/weight_sync_cost.py --markdown        # the table of docs/results/benchmarks.md beside published numbers
    python tools/bench/weight_sync_cost.py --json rows.json  # + the fit of measured CPU rows
    python tools/bench/weight_sync_cost.py --delta-fraction 0.01 --bucket-gib 0.5 --concurrent-server-updates
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "launch" / "configs"
FLAGSHIPS = ("qwen3_30b_a3b_gspo.yaml", "qwen3_235b_a22b_gspo.yaml", "deepseek_v3_671b_gspo.yaml")
BF16 = 2
GB = 1e9

# The published config.json fields the inventory reads, keyed by the checkpoint's directory name (the
# last part of a config's model.hf_path).
MODELS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          moe_intermediate_size=768, intermediate_size=6144, mlp_only_layers=[],
                          decoder_sparse_step=1, tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                            moe_intermediate_size=1536, intermediate_size=12288, mlp_only_layers=[],
                            decoder_sparse_step=1, tie_word_embeddings=False),
    "DeepSeek-V3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
                        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
                        n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3, moe_layer_freq=1,
                        tie_word_embeddings=False),  # the multi-token-prediction layer is not pushed (RL reads none)
}
PUBLISHED_PARAMS = {"Qwen3-30B-A3B": 30.5e9, "Qwen3-235B-A22B": 235e9, "DeepSeek-V3": 671e9}

# What users compare with: published refit / weight-update times on H100s (seconds per push).
PUBLISHED_SECONDS = [
    ("NeMo-RL, NCCL reshard refit", "Qwen3-30B-A3B", "0.74-1.0"),
    ("NeMo-RL, NCCL reshard refit", "DeepSeek-V3", "2.4-2.8"),
    ("NeMo-RL, NCCL reshard refit", "Qwen3.5-397B", "~2"),
    ("Miles, RDMA P2P", "Qwen3-30B-A3B", "2.16"),
    ("Miles, RDMA P2P", "Qwen3-235B-A22B", "3.16"),
    ("Miles, RDMA P2P", "Kimi-K2", "7.2"),
    ("verl, delta_sharded (plain NCCL: 246-266 s)", "Qwen3-235B-A22B", "11-15"),
]
GOAL_S = {"Qwen3-30B-A3B": 0.5, "Qwen3-235B-A22B": 2.0, "DeepSeek-V3": 2.0}


@dataclass(frozen=True)
class Assumptions:
    """The GPU cluster the estimate is for (H100 nodes, 400 Gb/s InfiniBand per GPU)."""

    nic_gbps: float = 50.0          # per-GPU NIC, GB/s each way (400 Gb/s InfiniBand)
    nvlink_gbps: float = 450.0      # NVLink inside a node, GB/s one way per GPU (TP gathers, server rings)
    hbm_gbps: float = 3000.0        # HBM read for the verification checksums, GB/s
    http_rtt_s: float = 2e-3        # one HTTP round trip to a server (its handler included)
    launch_s: float = 30e-6         # launch latency of one collective
    p2p_s: float = 20e-6            # latency of one point-to-point message
    gpus_per_node: int = 8
    bucket_bytes: int = 1 << 30     # 1 GiB
    concurrent_server_updates: bool = False  # False: SGLang takes one update at a time per server
    delta_encoding: str = "element"  # element: int32 index + bf16 value per change; tensor: changed tensors whole

    def lines(self) -> list[str]:
        return [f"  {f.name} = {getattr(self, f.name)}" for f in fields(self)]


# ---------------------------------------------------------------- inventory

@dataclass(frozen=True)
class Tensor:
    """One HF tensor as pushed. layer: -1 = before the layers (embedding), num_layers = after them (final
    norm, lm_head). expert: routed expert id or None. split: "tp" / "etp" when megatron shards it over
    that group (the owner gathers it first), else None. fuse: tensors megatron keeps as one parameter
    (q/k/v; gate/up) share it, so they cost one gather."""

    name: str
    shape: tuple[int, ...]
    layer: int
    expert: int | None = None
    split: str | None = None
    fuse: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * BF16


def _mlp(p: str, layer: int, inter: int, h: int, split: str | None, expert: int | None = None) -> list[Tensor]:
    """gate/up/down of one SwiGLU MLP (a dense MLP, a shared expert or a routed expert)."""
    fuse = f"{p}fc1"
    return [Tensor(f"{p}gate_proj.weight", (inter, h), layer, expert, split, fuse),
            Tensor(f"{p}up_proj.weight", (inter, h), layer, expert, split, fuse),
            Tensor(f"{p}down_proj.weight", (h, inter), layer, expert, split)]


def _qwen3_moe_layer(c: dict[str, Any], i: int) -> list[Tensor]:
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = [Tensor(p + "input_layernorm.weight", (h,), i),
           Tensor(a + "q_proj.weight", (q, h), i, None, "tp", a + "qkv"),
           Tensor(a + "k_proj.weight", (kv, h), i, None, "tp", a + "qkv"),
           Tensor(a + "v_proj.weight", (kv, h), i, None, "tp", a + "qkv"),
           Tensor(a + "o_proj.weight", (h, q), i, None, "tp"),
           Tensor(a + "q_norm.weight", (hd,), i), Tensor(a + "k_norm.weight", (hd,), i),
           Tensor(p + "post_attention_layernorm.weight", (h,), i)]
    experts = num_experts(c)
    moe = experts > 0 and i not in (c.get("mlp_only_layers") or []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0
    if not moe:
        return out + _mlp(p + "mlp.", i, c["intermediate_size"], h, "tp")
    out.append(Tensor(p + "mlp.gate.weight", (experts, h), i))
    for e in range(experts):
        out += _mlp(f"{p}mlp.experts.{e}.", i, c["moe_intermediate_size"], h, "etp", e)
    return out


def _deepseek_v3_layer(c: dict[str, Any], i: int) -> list[Tensor]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v, kv_lora = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = [Tensor(p + "input_layernorm.weight", (h,), i)]
    if c.get("q_lora_rank"):  # the down projections are replicated under transformer-engine's spec
        out += [Tensor(a + "q_a_proj.weight", (c["q_lora_rank"], h), i),
                Tensor(a + "q_a_layernorm.weight", (c["q_lora_rank"],), i),
                Tensor(a + "q_b_proj.weight", (heads * (nope + rope), c["q_lora_rank"]), i, None, "tp")]
    else:
        out.append(Tensor(a + "q_proj.weight", (heads * (nope + rope), h), i, None, "tp"))
    out += [Tensor(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h), i),
            Tensor(a + "kv_a_layernorm.weight", (kv_lora,), i),
            Tensor(a + "kv_b_proj.weight", (heads * (nope + v), kv_lora), i, None, "tp"),
            Tensor(a + "o_proj.weight", (h, heads * v), i, None, "tp"),
            Tensor(p + "post_attention_layernorm.weight", (h,), i)]
    experts = c["n_routed_experts"]
    if i < c["first_k_dense_replace"] or i % c.get("moe_layer_freq", 1):
        return out + _mlp(p + "mlp.", i, c["intermediate_size"], h, "tp")
    out += [Tensor(p + "mlp.gate.weight", (experts, h), i),
            Tensor(p + "mlp.gate.e_score_correction_bias", (experts,), i)]
    out += _mlp(p + "mlp.shared_experts.", i, c["moe_intermediate_size"] * c["n_shared_experts"], h, "tp")
    for e in range(experts):
        out += _mlp(f"{p}mlp.experts.{e}.", i, c["moe_intermediate_size"], h, "etp", e)
    return out


LAYERS = {"qwen3_moe": _qwen3_moe_layer, "deepseek_v3": _deepseek_v3_layer}


def inventory(config: dict[str, Any]) -> list[Tensor]:
    """Every HF tensor a push sends for this HF config (config.json fields), in checkpoint order."""
    layer = LAYERS[config["model_type"]]
    n, h, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    out = [Tensor("model.embed_tokens.weight", (vocab, h), -1, None, "tp")]
    for i in range(n):
        out += layer(config, i)
    out.append(Tensor("model.norm.weight", (h,), n))
    if not config.get("tie_word_embeddings"):
        out.append(Tensor("lm_head.weight", (vocab, h), n, None, "tp"))
    return out


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (Qwen3-MoE's config.json says num_experts, or num_local_experts as
    transformers 5 writes it; DeepSeek-V3's n_routed_experts)."""
    return config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0


# ---------------------------------------------------------------- layouts

@dataclass(frozen=True)
class Layout:
    """A trainer layout and its servers, as a shipped config gives them."""

    config: str
    model: str
    tp: int
    pp: int
    ep: int
    etp: int
    world: int
    num_servers: int
    server_tp: int
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def name(self) -> str:
        return (f"tp{self.tp} pp{self.pp} ep{self.ep} etp{self.etp}, {self.world} GPUs; "
                f"{self.num_servers} x tp{self.server_tp}")

    def stage_of_layer(self, num_layers: int) -> list[int]:
        """The pipeline stage of each layer (megatron's split, uneven first / last stages as configured)."""
        first, last, pp = self.first_stage_layers, self.last_stage_layers, self.pp
        if first is None and last is None:
            if num_layers % pp:
                raise ValueError(f"{num_layers} layers do not split over pp={pp}")
            counts = [num_layers // pp] * pp
        else:
            middle = pp - (first is not None) - (last is not None)
            rest = num_layers - (first or 0) - (last or 0)
            if middle < 0 or (middle and rest % middle) or (not middle and rest):
                raise ValueError(f"{num_layers} layers do not split as first={first}, last={last} over pp={pp}")
            each = rest // middle if middle else 0
            counts = ([first] if first is not None else []) + [each] * middle + ([last] if last is not None else [])
        return [s for s, k in enumerate(counts) for _ in range(k)]

    def stage_base(self, stage: int) -> int:
        """Global rank of a stage's first rank (megatron orders ranks tp, [e]tp-ep-dp, then pp)."""
        return stage * (self.world // self.pp)


def layout_from_config(path: str | Path) -> Layout:
    """The trainer layout and servers of a launch config, read with yaml."""
    raw = yaml.safe_load(Path(path).read_text())
    par, roll, train = raw.get("parallel") or {}, raw.get("rollout") or {}, raw.get("train") or {}
    tp, pp, ep, etp = (int(par.get(k) or 1) for k in ("tp", "pp", "ep", "etp"))
    world = int(train.get("world_size") or 0) or pp * math.lcm(tp, ep * etp)
    model = Path(str((raw.get("model") or {}).get("hf_path") or "")).name
    return Layout(config=Path(path).name, model=model, tp=tp, pp=pp, ep=ep, etp=etp, world=world,
                  num_servers=int(roll.get("num_servers") or 1), server_tp=int(roll.get("tp_size") or 1),
                  first_stage_layers=par.get("first_stage_layers"), last_stage_layers=par.get("last_stage_layers"))


@dataclass
class Share:
    """What one owning trainer rank sends: its tensors, and what its TP / ETP gathers cost it."""

    rank: int
    tensors: list[Tensor]
    gather_in_bytes: float = 0.0   # bytes its gathers bring in (NVLink): (g - 1) / g of each split tensor
    gathers: int = 0               # gather collectives it takes part in

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def shares(tensors: Sequence[Tensor], config: dict[str, Any], layout: Layout) -> dict[int, Share]:
    """The owning ranks and their shares, by global rank: a stage's dense tensors on its first rank, the
    experts of (stage, EP rank e) on the stage's rank e * etp (which for e = 0 is the same rank)."""
    n = config["num_hidden_layers"]
    stage = layout.stage_of_layer(n)
    experts = num_experts(config)
    per_rank = experts // layout.ep if experts else 1
    out: dict[int, Share] = {}
    fused: dict[int, set[str]] = {}
    for t in tensors:
        s = 0 if t.layer < 0 else layout.pp - 1 if t.layer >= n else stage[t.layer]
        rank = layout.stage_base(s) + (0 if t.expert is None else (t.expert // per_rank) * layout.etp)
        share = out.setdefault(rank, Share(rank, []))
        share.tensors.append(t)
        g = {"tp": layout.tp, "etp": layout.etp}.get(t.split or "", 1)
        if g > 1:
            share.gather_in_bytes += t.nbytes * (g - 1) / g
            key = t.fuse or t.name
            if key not in fused.setdefault(rank, set()):
                fused[rank].add(key)
                share.gathers += 1
    return dict(sorted(out.items()))


# ---------------------------------------------------------------- one push

def payload(t: Tensor, mode: str, f: float, encoding: str = "element") -> float:
    """Bytes a tensor costs on the wire (expected), f of its elements changed, spread evenly. full: whole.
    delta, element: its changed elements, an int32 index and a bf16 value each, unless whole is smaller
    (moe-rl serve's sparse format). delta, tensor: whole when any element changed, else nothing (what
    an SGLang server takes: it has no loader for element deltas)."""
    if mode == "full":
        return float(t.nbytes)
    if encoding == "tensor":
        return t.nbytes * -math.expm1(t.numel * math.log1p(-f)) if f < 1 else float(t.nbytes)
    return t.numel * min(BF16, 6.0 * f)


def buckets(sizes: Iterable[float], cap: int) -> list[float]:
    """Greedy buckets of at most `cap` bytes in order (a bigger tensor gets one of its own): their sizes."""
    out: list[float] = []
    for s in sizes:
        if out and out[-1] + s <= cap:
            out[-1] += s
        else:
            out.append(s)
    return out


@dataclass
class Estimate:
    path: str
    mode: str
    busiest_rank: int
    busiest_sent: float          # bytes out of the busiest trainer rank
    busiest_received: float      # bytes into it (gathers, and the shares rank 0 collects in the funnel)
    server_gpu_in: float         # bytes into each server GPU
    collectives: int             # point-to-point messages + broadcasts + gathers, the whole job
    http_per_server: int
    collectives_per_server: int  # broadcasts each server GPU takes part in
    http_total: int
    groups_per_server_gpu: int
    buckets_per_server: int
    peak_extra: float            # bytes the busiest rank holds for the push, over its weights
    peak_note: str
    delta_reference: float       # bytes each sender keeps between pushes to diff against (delta only)
    links: dict[str, float]      # seconds each link needs for its bytes
    latencies: dict[str, float]  # serialized latencies, seconds

    @property
    def messages(self) -> int:
        return self.collectives + self.http_total

    @property
    def messages_per_server(self) -> int:
        return self.collectives_per_server + self.http_per_server

    @property
    def binding(self) -> str:
        top = max(self.links.values())
        return " = ".join(k for k, v in self.links.items() if v >= top * (1 - 1e-9))

    @property
    def fixed_s(self) -> float:
        """The round trips every push makes whatever its size (begin, end, ...)."""
        return sum(v for k, v in self.latencies.items() if k.startswith("begin"))

    @property
    def seconds(self) -> float:
        return max(self.links.values()) + sum(self.latencies.values())


def _server_links(a: Assumptions, layout: Layout, server_bytes: float, sources: int, verify: bool) -> dict[str, float]:
    """Links on a server's side: its NIC(s), the NVLink ring through its TP ranks, the checksums."""
    in_node = min(layout.server_tp, a.gpus_per_node)
    nics = min(sources, in_node) if a.concurrent_server_updates else 1
    out = {"server NIC in": server_bytes / (nics * a.nic_gbps * GB)}
    if in_node > 1:  # a GPU that no bucket enters through takes all of them over NVLink
        nvlink = server_bytes if nics < in_node else server_bytes * (1 - 1 / in_node)
        out["server NVLink"] = nvlink / (a.nvlink_gbps * GB)
    if verify:
        out["server HBM (checksum)"] = server_bytes / (a.hbm_gbps * GB)
    return out


def estimate(tensors: Sequence[Tensor], config: dict[str, Any], layout: Layout, path: str, mode: str,
             a: Assumptions = Assumptions(), f: float = 0.03) -> Estimate:
    """One push of `tensors` from `layout`'s trainer to its servers, by `path` (funnel | sources) and
    `mode` (full | delta with a changed fraction f)."""
    owners = shares(tensors, config, layout)
    pay = {r: [payload(t, mode, f, a.delta_encoding) for t in s.tensors] for r, s in owners.items()}
    total = sum(sum(p) for p in pay.values())
    S, rtt, launch = layout.num_servers, a.http_rtt_s, a.launch_s
    node = lambda r: r // a.gpus_per_node  # noqa: E731
    gathers = sum(s.gathers for s in owners.values())
    reference = 0.0
    if path == "funnel":
        plan = buckets((p for r in owners for p in pay[r]), a.bucket_bytes)  # rank-major, as all ranks agree
        own, rank0 = sum(pay.get(0, [])), owners.get(0, Share(0, []))
        near = sum(sum(pay[r]) for r in owners if r and node(r) == node(0))
        far = total - own - near
        p2p = sum(len(s.tensors) for r, s in owners.items() if r)
        links = {"rank 0 NVLink": (rank0.gather_in_bytes + near) / (a.nvlink_gbps * GB),
                 "rank 0 NIC in": far / (a.nic_gbps * GB),
                 "rank 0 NIC out": total / (a.nic_gbps * GB)}
        links |= _server_links(a, layout, total, 1, verify=False)
        latencies = {"p2p messages into rank 0": p2p * a.p2p_s,
                     "per bucket: HTTP round trip + broadcast launch": len(plan) * (rtt + launch),
                     "rank 0's gathers": rank0.gathers * launch,
                     "begin / end": 2 * rtt}
        if mode == "delta":
            reference = float(rank0.nbytes)
        return Estimate(path, mode, 0, total, total - own + rank0.gather_in_bytes, total,
                        collectives=p2p + len(plan) + gathers, http_per_server=len(plan) + 2,
                        collectives_per_server=len(plan), http_total=S * (len(plan) + 2), groups_per_server_gpu=1,
                        buckets_per_server=len(plan),
                        peak_extra=rank0.nbytes + 3 * max(plan, default=0),
                        peak_note="its own share, drained whole before the exchange, + 2 received buckets "
                                  "+ the flattened copy of the bucket it broadcasts",
                        delta_reference=reference, links=links, latencies=latencies)
    if path != "sources":
        raise ValueError(f"path must be funnel or sources, got {path!r}")
    plans = {r: buckets(pay[r], a.bucket_bytes) for r in owners}
    per_server = sum(len(p) for p in plans.values()) + 1  # + rank 0's last word: the version, after all
    fixed = 3 + (mode == "delta")  # begin, end, verify (+ the weight version each server holds, for a delta)
    busiest = max(owners, key=lambda r: (sum(pay[r]), -r))
    sent = sum(pay[busiest]) * S
    links = {"source NVLink": max(s.gather_in_bytes for s in owners.values()) / (a.nvlink_gbps * GB),
             "source NIC out": sent / (a.nic_gbps * GB)}
    links |= _server_links(a, layout, total, len(owners), verify=True)
    # A source launches one broadcast per server for each bucket; one at a time per server (SGLang), a
    # server's round trips queue behind each other, else each source waits only for its own.
    http = 0.0 if a.concurrent_server_updates else rtt
    server_chain = per_server * (http + launch)
    source_chain = max(s.gathers * launch + len(plans[r]) * (rtt - http + S * launch) for r, s in owners.items())
    latencies = {("per server: HTTP round trip + launch per bucket of every source" if server_chain >= source_chain
                  else "per source: gathers, and per bucket an HTTP round trip + S launches"):
                 max(server_chain, source_chain),
                 "begin / end / verify" + (" / version check" if mode == "delta" else ""): fixed * rtt}
    if mode == "delta":
        reference = float(owners[busiest].nbytes)
    return Estimate(path, mode, busiest, sent, owners[busiest].gather_in_bytes, total,
                    collectives=gathers + per_server * S, http_per_server=per_server + fixed,
                    collectives_per_server=per_server, http_total=S * (per_server + fixed),
                    groups_per_server_gpu=len(owners), buckets_per_server=per_server,
                    peak_extra=2 * max(plans[busiest], default=0), peak_note="2 buckets",
                    delta_reference=reference, links=links, latencies=latencies)


# ---------------------------------------------------------------- flagships

@dataclass
class Flagship:
    layout: Layout
    config: dict[str, Any]
    tensors: list[Tensor]
    estimates: list[Estimate]

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)


def flagship(config_path: str | Path, a: Assumptions, f: float) -> Flagship:
    layout = layout_from_config(config_path)
    if layout.model not in MODELS:
        raise SystemExit(f"{config_path}: model {layout.model!r} has no HF config here (known: {', '.join(MODELS)})")
    config = MODELS[layout.model]
    tensors = inventory(config)
    ests = [estimate(tensors, config, layout, p, m, a, f) for p in ("funnel", "sources") for m in ("full", "delta")]
    return Flagship(layout, config, tensors, ests)


def _gb(x: float) -> str:
    return f"{x / GB:,.1f}" if x >= 10 * GB else f"{x / GB:,.2f}"


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """A markdown table, the first `left` columns left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * left + ["---:"] * (len(head) - left)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def describe(fs: Flagship, a: Assumptions, f: float) -> str:
    L, c = fs.layout, fs.config
    published = PUBLISHED_PARAMS.get(L.model)
    off = (fs.params / published - 1) if published else float("nan")
    ok = "within 2%" if abs(off) <= 0.02 else "NOT within 2%"
    stage = L.stage_of_layer(c["num_hidden_layers"])
    owners = shares(fs.tensors, c, L)
    dense = [sum(t.nbytes for t in s.tensors if t.expert is None) for s in owners.values()]
    expert = [sum(t.nbytes for t in s.tensors if t.expert is not None) for s in owners.values()]
    total = sum(t.nbytes for t in fs.tensors)
    out = [f"## {L.model} ({L.config})",
           f"inventory: {len(fs.tensors):,} tensors, {fs.params / 1e9:.2f}B parameters (published "
           f"{published / 1e9:g}B: {off:+.1%}, {ok}), {_gb(total)} GB in bf16",
           f"trainer: {L.name} (dp {L.world // (L.tp * L.pp)}; layers per stage "
           f"{[stage.count(s) for s in range(L.pp)]})",
           f"owning ranks (sources): {len(owners)}, one per stage and EP rank with experts, each stage's first "
           f"rank with its dense tensors too; dense per stage "
           f"{_gb(min(d for d in dense if d))}-{_gb(max(dense))} GB, experts per (stage, EP rank) "
           f"{_gb(min(e for e in expert if e))}-{_gb(max(expert))} GB" if any(expert) else "no experts",
           ""]
    rows = []
    for e in fs.estimates:
        rows.append([f"{e.path} {e.mode}", f"rank {e.busiest_rank}", _gb(e.busiest_sent), _gb(e.busiest_received),
                     _gb(e.server_gpu_in), f"{e.messages:,} ({e.collectives:,} + {e.http_total:,} HTTP)",
                     f"{e.messages_per_server:,}", e.groups_per_server_gpu, _gb(e.peak_extra),
                     f"{e.seconds:.2f}", e.binding])
    out.append(table(["push", "busiest", "sent GB", "received GB", "server GPU in GB",
                      "messages (collectives + HTTP)", "per server", "groups / server GPU", "peak extra GB",
                      "estimate s", "binding link"], rows, left=2))
    out.append("")
    for e in fs.estimates:
        links = ", ".join(f"{k} {v:.3f}" for k, v in e.links.items())
        lat = ", ".join(f"{k} {v:.3f}" for k, v in e.latencies.items())
        ref = f"; keeps {_gb(e.delta_reference)} GB to diff against between pushes" if e.mode == "delta" else ""
        out.append(f"- {e.path} {e.mode}: links (s): {links}. Serialized (s): {lat}. "
                   f"Peak extra on rank {e.busiest_rank}: {e.peak_note}{ref}.")
    return "\n".join(out)


def verdicts(flagships: Sequence[Flagship], a: Assumptions, f: float) -> list[str]:
    """Plainly, per flagship and mode: does the sources path's estimate meet the goal, and what binds;
    and what a server taking several sources' updates at once would change."""
    out = []
    for fs in flagships:
        goal = GOAL_S.get(fs.layout.model)
        if goal is None:
            continue
        by = {(e.path, e.mode): e for e in fs.estimates}
        for mode in ("full", "delta"):
            e = by["sources", mode]
            meets = "meets" if e.seconds <= goal else "misses"
            line = (f"- {fs.layout.model}, sources {mode}: estimate {e.seconds:.2f} s {meets} the goal of "
                    f"<= {goal:g} s; binds: {e.binding} ({max(e.links.values()):.2f} s of {e.seconds:.2f} s; "
                    f"serialized latencies {sum(e.latencies.values()):.2f} s)")
            if not a.concurrent_server_updates:
                w = estimate(fs.tensors, fs.config, fs.layout, "sources", mode,
                             replace(a, concurrent_server_updates=True), f)
                line += (f"; were a server to take several sources' buckets at once: {w.seconds:.2f} s "
                         f"({'meets' if w.seconds <= goal else 'misses'}), binds: {w.binding}")
            if mode == "delta" and a.delta_encoding == "element":
                w = estimate(fs.tensors, fs.config, fs.layout, "sources", mode, replace(a, delta_encoding="tensor"), f)
                full = by["sources", "full"].server_gpu_in
                line += (f". On SGLang, which takes no element deltas, changed tensors go whole: "
                         f"{w.server_gpu_in / full:.1%} of the full bytes, {w.seconds:.2f} s")
            out.append(line)
    return out


def markdown(flagships: Sequence[Flagship], a: Assumptions, f: float) -> str:
    rows = []
    for fs in flagships:
        by = {(e.path, e.mode): e for e in fs.estimates}
        for path in ("funnel", "sources"):
            full, delta = by[path, "full"], by[path, "delta"]
            rows.append([fs.layout.model, fs.layout.name, path, _gb(full.busiest_sent + full.busiest_received),
                         f"{_gb(full.server_gpu_in)} / {_gb(delta.server_gpu_in)}",
                         f"{full.messages:,} / {delta.messages:,}",
                         f"{full.seconds:.2f}", f"{delta.seconds:.2f}", full.binding])
    out = [f"Weight push, estimate (tools/bench/weight_sync_cost.py; delta: {f:.0%} of the values changed; "
           f"{a.nic_gbps:g} GB/s NIC and {a.nvlink_gbps:g} GB/s NVLink per GPU, {a.http_rtt_s * 1e3:g} ms per HTTP "
           f"call, {a.bucket_bytes / 2**30:g} GiB buckets; not measured):", "",
           table(["model", "layout", "path", "busiest-rank GB out + in (full)", "server-GPU GB in (full / delta)",
                  "messages (full / delta)", "estimate s (full)", "estimate s (delta)", "binding link (full)"], rows,
                 left=3),
           "", "Published (H100), for comparison:", "",
           table(["system", "model", "seconds per push"], PUBLISHED_SECONDS, left=2), "",
           "Against the goal (<= 0.5 s Qwen3-30B-A3B, <= 2 s Qwen3-235B-A22B and DeepSeek-V3):", ""]
    return "\n".join(out + verdicts(flagships, a, f))


# ---------------------------------------------------------------- fit of measured CPU rows

def load_rows(path: str | Path) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise SystemExit(f"{path}: expected a list of rows or {{\"rows\": [...]}}")
    need = ("path", "mode", "ranks", "model_bytes", "busiest_rank_bytes", "messages_per_push", "push_s")
    for i, r in enumerate(rows):
        missing = [k for k in need if k not in r]
        if missing:
            raise SystemExit(f"{path}: row {i} lacks {', '.join(missing)}")
    return rows


def fit_linear(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """push_s = a + b * busiest_rank_bytes + c * messages_per_push, least squares; a, b, c, R^2, n."""
    import numpy as np

    X = np.array([[1.0, float(r["busiest_rank_bytes"]), float(r["messages_per_push"])] for r in rows])
    y = np.array([float(r["push_s"]) for r in rows])
    scale = np.maximum(np.abs(X).max(axis=0), 1e-300)  # bytes ~1e9 and counts ~1e4: condition the solve
    coef, *_ = np.linalg.lstsq(X / scale, y, rcond=None)
    coef = coef / scale
    resid = y - X @ coef
    tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / tot if tot > 0 else float("nan")
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "r2": r2, "n": len(rows)}


def loglog_slopes(rows: Sequence[dict[str, Any]], y_key: str) -> dict[str, float | None]:
    """Slopes of log y against log model_bytes and log ranks, fitted together (each with the other held
    fixed); None for a variable that does not vary in these rows."""
    import numpy as np

    xs = {k: np.log([float(r[k]) for r in rows]) for k in ("model_bytes", "ranks")}
    varying = [k for k, v in xs.items() if len(v) and np.ptp(v) > 1e-12]
    out: dict[str, float | None] = {k: None for k in xs}
    if not varying or len(rows) < len(varying) + 1:
        return out
    X = np.column_stack([np.ones(len(rows))] + [xs[k] for k in varying])
    coef, *_ = np.linalg.lstsq(X, np.log([float(r[y_key]) for r in rows]), rcond=None)
    out.update({k: float(c) for k, c in zip(varying, coef[1:])})
    return out


def fit_report(rows: Sequence[dict[str, Any]], flagships: Sequence[Flagship], a: Assumptions) -> str:
    bad = [r for r in rows if r.get("verified") is False]
    rows = [r for r in rows if r.get("verified") is not False and float(r.get("push_s") or 0) > 0]
    out = [f"## Fit of {len(rows)} measured CPU rows" + (f" ({len(bad)} unverified rows left out)" if bad else "")]
    fits: dict[str, dict[str, float]] = {}
    for path in ("funnel", "sources"):
        mine = [r for r in rows if r.get("path") == path]
        if len(mine) < 3:
            out.append(f"- {path}: {len(mine)} rows, too few to fit 3 constants")
            continue
        fit = fits[path] = fit_linear(mine)
        eff = f"{1 / fit['b'] / GB:.2f} GB/s" if fit["b"] > 0 else "n/a"
        out.append(f"- {path}: push_s = {fit['a']:.4f} s + {fit['b'] * GB:.4f} s/GB x busiest_rank_bytes "
                   f"(effective {eff}) + {fit['c'] * 1e3:.4f} ms x messages_per_push; R^2 = {fit['r2']:.4f} "
                   f"over {fit['n']} rows")
        for mode in ("full", "delta"):
            sub = [r for r in mine if r.get("mode") == mode]
            if not sub:
                continue
            parts = []
            for key in ("busiest_rank_bytes", "push_s"):
                s = loglog_slopes(sub, key)
                slopes = ", ".join(f"vs {k} {'n/a' if v is None else f'{v:+.2f}'}" for k, v in s.items())
                parts.append(f"{key}: {slopes}")
            out.append(f"  - {mode} ({len(sub)} rows), log-log slopes: " + "; ".join(parts))
    out += ["", "The same formula at the flagship shapes (busiest-rank bytes = sent + received), with the CPU-fitted "
            "constants, and with GPU constants: a = the fixed HTTP round trips (begin, end, ...), b = 1 / NIC on "
            "the bytes the busiest rank sends (its NIC is full duplex: what it receives comes in meanwhile), "
            "c = the modelled serialized latency per message. The link model beside it also sees the servers' "
            "side:", ""]
    trows = []
    for fs in flagships:
        for e in fs.estimates:
            busiest = e.busiest_sent + e.busiest_received
            cpu = fits.get(e.path)
            cpu_s = f"{cpu['a'] + cpu['b'] * busiest + cpu['c'] * e.messages:,.1f}" if cpu else "n/a"
            c_gpu = (sum(e.latencies.values()) - e.fixed_s) / max(e.messages, 1)
            gpu_s = e.fixed_s + e.busiest_sent / (a.nic_gbps * GB) + c_gpu * e.messages
            trows.append([fs.layout.model, f"{e.path} {e.mode}", _gb(busiest), f"{e.messages:,}", cpu_s,
                          f"{c_gpu * 1e6:.1f}", f"{gpu_s:.2f}", f"{e.seconds:.2f}"])
    out.append(table(["model", "push", "busiest-rank GB", "messages", "CPU constants s", "GPU c us/message",
                      "GPU constants s", "link model s"], trows))
    return "\n".join(out)


# ---------------------------------------------------------------- main

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=[str(CONFIGS / n) for n in FLAGSHIPS],
                    help="launch configs to estimate (default: the three flagships)")
    ap.add_argument("--delta-fraction", type=float, default=0.03, help="fraction of values a delta push changes")
    ap.add_argument("--bucket-gib", type=float, default=1.0)
    ap.add_argument("--delta-encoding", choices=("element", "tensor"), default="element",
                    help="element: int32 index + bf16 value per changed value (moe-rl serve); tensor: changed "
                         "tensors whole (SGLang, which has no loader for element deltas)")
    ap.add_argument("--concurrent-server-updates", action="store_true",
                    help="assume a server takes its sources' updates at once (SGLang takes one at a time)")
    ap.add_argument("--json", help="rows measured on CPU by the scale benchmark: fit them")
    ap.add_argument("--markdown", action="store_true", help="print the Markdown table of docs/results/benchmarks.md")
    args = ap.parse_args(argv)
    if not 0 < args.delta_fraction <= 1:
        ap.error("--delta-fraction must be in (0, 1]")
    a = replace(Assumptions(), bucket_bytes=int(args.bucket_gib * 2**30),
                concurrent_server_updates=args.concurrent_server_updates, delta_encoding=args.delta_encoding)
    f = args.delta_fraction
    flagships = [flagship(p, a, f) for p in args.configs]
    if args.markdown:
        print(markdown(flagships, a, f))
    else:
        print(f"# Weight push cost model (estimate; delta: {f:.0%} of the values changed)\n\nAssumptions:")
        print("\n".join(a.lines()) + "\n")
        for fs in flagships:
            print(describe(fs, a, f) + "\n")
        print("\n".join(verdicts(flagships, a, f)))
    if args.json:
        print("\n" + fit_report(load_rows(args.json), flagships, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
