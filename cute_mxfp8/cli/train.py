"""``python -m cute_mxfp8 train``: train one small LM twice, high precision vs MXFP8, and compare.

Both runs start from the same initial weights (the model is built once and deep-copied) and see the same
batches in the same order; the steps are interleaved so one progress bar shows both losses.  The high-precision
run uses bf16 autocast with fp32 parameters on CUDA and plain fp32 on CPU; the MXFP8 run is the deep copy after
``cute_mxfp8.nn.convert_to_mxfp8`` under the same autocast setting.  Results go to ``--out``:
``summary.json`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from cute_mxfp8.cli.checks import device_problem
from cute_mxfp8.cli.data import BatchSampler, fixed_batches, load_tokens, split_tokens
from cute_mxfp8.cli.model import ModelConfig, Transformer

__all__ = ["add_args", "validate_args", "run"]

GAP_TOLERANCE_PCT = 2.0  # warn when |eval gap| exceeds this
EVAL_SEED = 1234  # the eval set does not depend on --seed
FINAL_TRAIN_WINDOW = 10  # "final train loss" = mean of the last this-many step losses
MX_BLOCK = 32  # --dim and --hidden must be multiples of the MX scaling block so the layers convert to MXFP8


MOE_DEFAULTS = {"experts": 4, "top_k": 2}  # --experts / --top-k when --moe is given without them


def _moe_value(args: argparse.Namespace, attr: str):
    """``--experts`` / ``--top-k`` as given, else its :data:`MOE_DEFAULTS` value."""
    value = getattr(args, attr, None)
    return MOE_DEFAULTS[attr] if value is None else value


def add_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags to ``parser``."""
    g = parser.add_argument_group("training")
    g.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=None, help="linear warmup steps, >= 0 (default: 5%% of --steps)")
    g.add_argument("--seed", type=int, default=0, help="seed for init and batch order (default: %(default)s)")
    g.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'")
    m = parser.add_argument_group("model")
    m.add_argument("--dim", type=int, default=128, help="model width, multiple of 32 (default: %(default)s)")
    m.add_argument("--hidden", type=int, default=384, help="FFN hidden width, multiple of 32 (default: %(default)s)")
    m.add_argument("--layers", type=int, default=2, help="transformer blocks (default: %(default)s)")
    m.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    m.add_argument("--moe", action="store_true", help="use a top-k routed MoE FFN instead of a dense one")
    m.add_argument("--experts", type=int, default=None,
                   help=f"MoE experts, with --moe (default: {MOE_DEFAULTS['experts']})")
    m.add_argument("--top-k", type=int, default=None,
                   help=f"experts per token, with --moe (default: {MOE_DEFAULTS['top_k']})")
    m.add_argument("--hopper-block-k", type=int, choices=[32, 128], default=32,
                   help="MXFP8Config(hopper_block_k=...) of the mxfp8 run: 128 is the Hopper fast mode (1x128 shared "
                        "scales, needs --hidden %% 128 == 0; the sm100 backend ignores it) (default: %(default)s)")
    m.add_argument("--hopper-weight-blocks", choices=["1x128", "128x128"], default="1x128",
                   help="MXFP8Config(hopper_weight_blocks=...) with --hopper-block-k 128: the weights' scale blocks "
                        "(default: %(default)s)")
    o = parser.add_argument_group("eval and output")
    o.add_argument("--eval-batches", type=int, default=8, help="fixed held-out batches per eval (default: %(default)s)")
    o.add_argument("--eval-every", type=int, default=None, help="steps between evals, plus one at the end (default: 4 evenly spaced evals)")
    o.add_argument("--log-every", type=int, default=25,
                   help="print a loss line every N steps, the first and the last; 0: none (default: %(default)s)")
    o.add_argument("--out", default=os.path.join("runs", "train"), help="output directory (default: %(default)s)")
    o.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _check_out(path: str) -> str | None:
    """None if ``--out path`` is (or can be created as) a writable directory, else the error message."""
    if not path:
        return "argument --out: must not be empty"
    full = os.path.abspath(path)
    if os.path.lexists(full):
        if not os.path.isdir(full):
            return f"argument --out: {path!r} exists and is not a directory"
        if not os.access(full, os.W_OK | os.X_OK):
            return f"argument --out: directory {path!r} is not writable"
        return None
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"argument --out: cannot create directory {path!r}: {parent!r} exists and is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"argument --out: cannot create directory {path!r}: {parent!r} is not writable"
    return None


def validate_args(args: argparse.Namespace) -> str | None:
    """Check the ``train`` arguments before anything runs; None if fine, else one message listing every problem.

    The parser reports it with ``parser.error``; :func:`run` raises ``SystemExit`` with it.
    """
    errors: list[str] = []

    def positive(flag: str, value) -> bool:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            errors.append(f"argument {flag}: must be a positive integer, got {value!r}")
            return False
        return True

    def non_negative(flag: str, value) -> bool:
        if value is not None and (not isinstance(value, int) or value < 0):
            errors.append(f"argument {flag}: must be an integer >= 0, got {value!r}")
            return False
        return True

    for flag, attr in [("--steps", "steps"), ("--batch-size", "batch_size"), ("--seq-len", "seq_len"),
                       ("--layers", "layers"), ("--eval-batches", "eval_batches")]:  # fmt: skip
        positive(flag, getattr(args, attr))
    dims_ok = True
    for flag, attr in [("--dim", "dim"), ("--hidden", "hidden")]:
        value = getattr(args, attr)
        if not isinstance(value, int) or value < 1 or value % MX_BLOCK:
            errors.append(f"argument {flag}: must be a positive multiple of {MX_BLOCK} (the MX block size, so the "
                          f"layers can run in MXFP8), got {value!r}")  # fmt: skip
            dims_ok = False
    if positive("--heads", args.heads) and dims_ok:
        if args.dim % args.heads:
            errors.append(f"argument --heads: --dim {args.dim} is not divisible by --heads {args.heads}")
        elif (args.dim // args.heads) % 2:
            errors.append(f"argument --heads: head dim --dim/--heads = {args.dim // args.heads} must be even for RoPE")
    if getattr(args, "hopper_block_k", 32) == 128 and isinstance(args.hidden, int) and args.hidden % 128:
        errors.append(f"argument --hopper-block-k: 128 needs --hidden to be a multiple of 128, got {args.hidden}")
    if getattr(args, "hopper_weight_blocks", "1x128") != "1x128" and getattr(args, "hopper_block_k", 32) != 128:
        errors.append("argument --hopper-weight-blocks: 128x128 needs --hopper-block-k 128")
    given = [flag for flag, attr in (("--experts", "experts"), ("--top-k", "top_k")) if getattr(args, attr) is not None]
    if given and not args.moe:  # (they were silently ignored)
        errors.append(f"argument {given[0]}: sets the routed MoE FFN, which only --moe builds: add --moe or drop "
                      f"{' and '.join(given)}")
    experts, top_k = _moe_value(args, "experts"), _moe_value(args, "top_k")
    experts_ok = positive("--experts", experts)
    if positive("--top-k", top_k) and experts_ok and args.moe and top_k > experts:
        errors.append(f"argument --top-k: must be in [1, --experts {experts}], got {top_k}")
    if not isinstance(args.lr, (int, float)) or not math.isfinite(args.lr) or args.lr <= 0:
        errors.append(f"argument --lr: must be a finite number > 0, got {args.lr!r}")
    if (non_negative("--warmup", args.warmup) and args.warmup is not None and isinstance(args.steps, int)
            and args.warmup > args.steps >= 1):
        errors.append(f"argument --warmup: must be <= --steps {args.steps} (the learning rate would never reach "
                      f"--lr), got {args.warmup}")
    non_negative("--log-every", args.log_every)
    if args.eval_every is not None:
        positive("--eval-every", args.eval_every)
    if isinstance(args.seq_len, int) and args.seq_len >= 1:
        _, eval_tokens = split_tokens(load_tokens(), 0.1)
        if args.seq_len >= len(eval_tokens):
            errors.append(f"argument --seq-len: must be < {len(eval_tokens)} (the held-out eval bytes), "
                          f"got {args.seq_len}")  # fmt: skip
    for msg in (device_problem(args.device), _check_out(args.out)):
        if msg:
            errors.append(msg)
    return "; ".join(errors) or None


def resolve_device(name: str) -> torch.device:
    """``'auto'`` -> cuda if available else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(step: int, steps: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``final_frac * peak`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class _Run:
    """One training run's model, optimizer and measurements."""

    name: str  # display name
    key: str  # summary.json key
    model: Transformer
    optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
    losses: list = field(default_factory=list)
    evals: list = field(default_factory=list)  # [step, eval loss]; step counts completed optimizer steps
    timed_seconds: float = 0.0
    timed_tokens: int = 0
    total_seconds: float = 0.0


def _adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW, betas (0.9, 0.95); weight decay 0.1 on matrices (ndim >= 2), none on norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(r: _Run, x, y, lr: float, amp, device: torch.device) -> tuple[float, float]:
    """One optimizer step; returns (loss, seconds) with the device synchronized around it."""
    _sync(device)
    t0 = time.perf_counter()
    for group in r.optimizer.param_groups:
        group["lr"] = lr
    with amp():
        loss = r.model.loss(x, y)
    r.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(r.model.parameters(), 1.0)
    r.optimizer.step()
    value = loss.item()  # synchronizes
    _sync(device)
    return value, time.perf_counter() - t0


@torch.no_grad()
def _evaluate(model: Transformer, batches, amp) -> float:
    """Mean loss over the fixed eval batches."""
    model.eval()
    try:
        total = 0.0
        for x, y in batches:
            with amp():
                total += model.loss(x, y).item()
        return total / len(batches)
    finally:
        model.train()


def _report_lists(report) -> tuple[list, list]:
    converted = [list(item) for item in getattr(report, "converted", [])]
    skipped = [list(item) for item in getattr(report, "skipped", [])]
    return converted, skipped


def _json_safe(obj):
    """``obj`` with every non-finite float replaced by None, so it dumps as strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _fmt(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def _plot(path: str, runs: list[_Run], gap_pct: float, title_extra: str) -> None:
    """Train-loss curves and eval points of both runs into ``path`` (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"high precision": "tab:blue", "mxfp8": "tab:orange"}
    for r in runs:
        c = colors.get(r.name)
        ax.plot(range(1, len(r.losses) + 1), r.losses, color=c, alpha=0.8, lw=1.0, label=f"{r.name} train")
        if r.evals:
            s, v = zip(*r.evals)
            ax.plot(s, v, "o--", color=c, ms=6, mec="black", label=f"{r.name} eval")
    ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="ln 256 (uniform)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(f"MXFP8 vs high precision: eval gap {gap_pct:+.2f}%\n{title_extra}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Train both runs, print the comparison, write ``summary.json`` and ``loss.png``; returns 0."""
    from tqdm.auto import tqdm

    from cute_mxfp8.nn import MXFP8Config, convert_to_mxfp8
    from cute_mxfp8.ops import resolve_backend
    from cute_mxfp8.ops.autograd import fused_epilogues_enabled, scale_block

    problem = validate_args(args)
    if problem:
        raise SystemExit(f"error: {problem}")
    # The output directory exists before training, so a bad --out fails now rather than after the runs.
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create output directory {args.out!r}: {e}") from None
    device = resolve_device(args.device)
    precision = "bf16 autocast, fp32 params" if device.type == "cuda" else "fp32"

    def amp():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    steps = args.steps
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    if args.eval_every:
        eval_steps = set(range(args.eval_every, steps + 1, args.eval_every)) | {steps}
    else:
        eval_steps = {max(1, round(steps * i / 4)) for i in range(1, 5)}

    cfg = ModelConfig(
        dim=args.dim, hidden=args.hidden, layers=args.layers, heads=args.heads,
        max_seq_len=max(args.seq_len, 1), moe=args.moe, num_experts=_moe_value(args, "experts"),
        top_k=_moe_value(args, "top_k"),
    )  # fmt: skip

    # Data: identical batches for both runs.
    tokens = load_tokens()
    train_tokens, eval_tokens = split_tokens(tokens, 0.1)
    sampler = BatchSampler(train_tokens, args.batch_size, args.seq_len, args.seed, device)
    eval_set = fixed_batches(eval_tokens, args.eval_batches, args.batch_size, args.seq_len, EVAL_SEED, device)

    # Models: one init, deep-copied; the copy is converted in place.
    torch.manual_seed(args.seed)
    base = Transformer(cfg)
    hp = _Run("high precision", "high_precision", base.to(device))
    mx = _Run("mxfp8", "mxfp8", copy.deepcopy(hp.model))
    n_params = sum(p.numel() for p in hp.model.parameters())
    mx_config = MXFP8Config(hopper_block_k=getattr(args, "hopper_block_k", 32),
                            hopper_weight_blocks=getattr(args, "hopper_weight_blocks", "1x128"))
    report = convert_to_mxfp8(mx.model, config=mx_config)
    # which backend runs each kind of op (kernels may cover some ops before others)
    op_backends = {kind: str(resolve_backend(device, op=op))
                   for kind, op in (("quantize", "quantize_dual"), ("swiglu", "swiglu_quant"), ("gemm", "mm"))}
    backend = ", ".join(f"{kind}={name}" for kind, name in op_backends.items())
    if len(set(op_backends.values())) == 1:
        backend = op_backends["gemm"]
    swiglu = ("fused into the GEMM epilogues" if fused_epilogues_enabled(mx_config, device, cfg.hidden, cfg.moe)
              else "GEMM, then the fused SwiGLU cast")
    converted, skipped = _report_lists(report)
    nothing_converted = not converted
    no_mx_warning = (
        "WARNING: the converter replaced no module with an MXFP8 one, so the 'mxfp8' run is identical to the "
        "high-precision run and the comparison means nothing (are --dim and --hidden multiples of 32?)"
    )
    for r in (hp, mx):
        r.optimizer = _adamw(r.model, args.lr)

    tokens_per_step = args.batch_size * args.seq_len
    fast = (f" | Hopper fast mode (hopper_block_k=128, {mx_config.hopper_weight_blocks} weight blocks)"
            if scale_block(mx_config, device) == 128 else "")
    print(f"device: {device} | high-precision run: {precision} | mxfp8 backend: {backend} | SwiGLU: {swiglu}{fast}")
    print(
        f"model: {'MoE' if cfg.moe else 'dense'} dim={cfg.dim} hidden={cfg.hidden} layers={cfg.layers} "
        f"heads={cfg.heads}" + (f" experts={cfg.num_experts} top_k={cfg.top_k}" if cfg.moe else "")
        + f" | {n_params / 1e6:.2f}M params"
    )
    print(
        f"data: pydoc_data.topics, {len(train_tokens):,} train / {len(eval_tokens):,} eval bytes | "
        f"{steps} steps x {args.batch_size} x {args.seq_len} = {tokens_per_step:,} tokens/step | "
        f"lr {args.lr:g}, warmup {warmup}, cosine"
    )
    print("conversion report:")
    print(str(report))
    if nothing_converted:
        print(no_mx_warning)
    sys.stdout.flush()

    # Throughput excludes the first steps (allocator warm-up, kernel JIT/autotune) when there are enough steps.
    untimed = 2 if steps > 4 else 0
    bar = tqdm(range(steps), desc="train", dynamic_ncols=True, disable=args.no_progress or None, file=sys.stderr)
    for step in bar:
        x, y = next(sampler)
        lr = lr_at(step, steps, args.lr, warmup)
        for r in (hp, mx):
            loss, dt = _train_step(r, x, y, lr, amp, device)
            r.losses.append(loss)
            r.total_seconds += dt
            if step >= untimed:
                r.timed_seconds += dt
                r.timed_tokens += tokens_per_step
        bar.set_postfix(hp=f"{hp.losses[-1]:.4f}", mxfp8=f"{mx.losses[-1]:.4f}", refresh=False)
        done = step + 1
        if args.log_every > 0 and (done % args.log_every == 0 or done == 1 or done == steps):
            tqdm.write(
                f"step {done:>{len(str(steps))}}/{steps} | lr {lr:.2e} | "
                f"hp loss {_fmt(hp.losses[-1])} | mxfp8 loss {_fmt(mx.losses[-1])}",
                file=sys.stdout,
            )
        if done in eval_steps:
            for r in (hp, mx):
                r.evals.append([done, _evaluate(r.model, eval_set, amp)])
            tqdm.write(f"eval @ step {done}: hp {_fmt(hp.evals[-1][1])} | mxfp8 {_fmt(mx.evals[-1][1])}", file=sys.stdout)
    bar.close()

    results = {}
    for r in (hp, mx):
        tail = r.losses[-FINAL_TRAIN_WINDOW:]
        results[r.key] = {
            "final_train_loss": sum(tail) / len(tail),
            "last_step_loss": r.losses[-1],
            "final_eval_loss": r.evals[-1][1],
            "tokens_per_s": r.timed_tokens / r.timed_seconds if r.timed_seconds > 0 else float("nan"),
            "train_seconds": r.total_seconds,
            "train_losses": r.losses,
            "evals": r.evals,
        }
    e_hp, e_mx = results["high_precision"]["final_eval_loss"], results["mxfp8"]["final_eval_loss"]
    gap_pct = (e_mx - e_hp) / e_hp * 100.0
    # None (null in summary.json) when nothing ran in MXFP8: there is no comparison to judge.
    ok = None if nothing_converted else math.isfinite(gap_pct) and abs(gap_pct) <= GAP_TOLERANCE_PCT

    print()
    print(f"{'run':<16}{'train loss':>12}{'eval loss':>12}{'tokens/s':>12}{'time (s)':>10}")
    for r in (hp, mx):
        res = results[r.key]
        print(
            f"{r.name:<16}{_fmt(res['final_train_loss']):>12}{_fmt(res['final_eval_loss']):>12}"
            f"{res['tokens_per_s']:>12,.0f}{res['train_seconds']:>10.1f}"
        )
    print(f"train loss = mean of the last {min(FINAL_TRAIN_WINDOW, steps)} steps; "
          f"eval loss = mean over {args.eval_batches} fixed held-out batches")  # fmt: skip
    print(f"eval loss gap (mxfp8 vs high precision): {gap_pct:+.2f}%")
    print(f"device: {device} | high precision: {precision} | mxfp8 backend: {backend}")
    if nothing_converted:
        print(no_mx_warning)
    elif not ok:
        print(
            f"WARNING: MXFP8 eval loss {_fmt(e_mx)} is not within {GAP_TOLERANCE_PCT:g}% of the "
            f"high-precision eval loss {_fmt(e_hp)} (gap {gap_pct:+.2f}%)"
        )

    summary = {
        "device": str(device),
        "backend": backend,
        "op_backends": op_backends,
        "swiglu": swiglu,
        "scale_block": scale_block(mx_config, device),
        "high_precision_dtype": precision,
        "torch_version": torch.__version__,
        "args": {**{k: v for k, v in vars(args).items() if not callable(v)},
                 **({k: _moe_value(args, k) for k in MOE_DEFAULTS} if args.moe else {})},  # (the values used)
        "model_config": cfg.to_dict(),
        "num_params": n_params,
        "steps": steps,
        "warmup_steps": warmup,
        "tokens_per_step": tokens_per_step,
        "throughput_untimed_steps": untimed,
        "eval_steps": sorted(eval_steps),
        "data": {"source": "pydoc_data.topics", "train_tokens": len(train_tokens), "eval_tokens": len(eval_tokens)},
        "eval_gap_pct": gap_pct,
        "gap_tolerance_pct": GAP_TOLERANCE_PCT,
        "within_tolerance": ok,
        "mxfp8_layers": len(converted),
        "runs": results,
        "conversion": {"converted": converted, "skipped": skipped, "summary": str(report)},
    }
    summary_path = os.path.join(args.out, "summary.json")
    with open(summary_path, "w") as f:
        json.dump(_json_safe(summary), f, indent=2, allow_nan=False)
    plot_path = os.path.join(args.out, "loss.png")
    _plot(plot_path, [hp, mx], gap_pct, f"{device}, backend {backend}, {steps} steps, {n_params / 1e6:.2f}M params")
    print(f"wrote {summary_path} and {plot_path}")
    return 0
