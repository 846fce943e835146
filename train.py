"""Position-debiasing fine-tunes: `python train.py +exp=in2` (Hydra config tree in conf/).

One loop for every setting, read top to bottom: build tokenizer, data, model and engine; then for
each step measure the Jacobian profile (before the update, so step 0 is the initial model), take
one optimizer step over `grad_accum` micro-batches, log, evaluate and save.
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tqdm import tqdm

from analysis.jacobian import JacobianConfig
from analysis.metrics_log import LoggerConfig, MetricsLogger, NullLogger
from analysis.positional_eval import EvalConfig
from data_builders.in2 import DataConfig
from models.build import ModelConfig
from models.distributed import dist_info
from models.peft_setup import PeftConfig


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warm-up
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    micro_batch_size: int = 8  # samples per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    device: str = "cpu"  # cpu | cuda | auto
    resume_from: Optional[str] = None  # checkpoint folder, or `latest` of this run directory
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last_n: int = 2  # checkpoints kept; 0 = all
    max_bad_steps: int = 10  # non-finite losses tolerated (skipped) before the run stops
    deepspeed: Optional[dict[str, Any]] = None  # DeepSpeed config block (trainer=zero2/zero3/...)
    collective_timeout_s: float = 1800.0  # a collective (or joining the group) that takes longer fails


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    jacobian: JacobianConfig = field(default_factory=JacobianConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    exp_name: str = "default"  # names the run directory outputs/<exp_name>/<time>


def run_stamp() -> str:
    """Run directory timestamp, identical on every rank of one launch.

    Each rank resolves Hydra's run directory on its own, and `${now:}` can straddle a second
    between them. Ranks started by `deepspeed` or `torchrun` share their parent (the launcher), so
    its start time names the run instead.
    """
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    else:
        started = time.time()
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started))


def register_configs() -> None:
    """Typed schemas: the composed config must match `TrainConfig`, unknown keys fail at start-up."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)


register_configs()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, dataset, batch_size: int, pad_id: int, device: torch.device) -> float:
    """Token-weighted mean loss over the held-out split (answer tokens only, as in training)."""
    from data_builders.collate import collate

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = collate(dataset.select(range(start, min(len(dataset), start + batch_size))), pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, L, V)
        labels = batch["labels"][:, 1:]  # (B, L-1)
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        total += nll.item()
        count += int((labels != -100).sum())
    model.train(was_training)
    return total / max(1, count)


class StopRequest:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves and exits cleanly."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def wandb_image(png: Path):
    import wandb

    return wandb.Image(str(png))


CHART_POINTS = 128  # positions per curve in the wandb profile chart (jacobian.npz keeps all L)


def profile_charts(results: dict, metrics: dict[str, float], n_layers: int, step: int) -> dict[str, Any]:
    """wandb line charts of each set's mean profile (log10) with the prior fitted in `metrics`."""
    import wandb

    from analysis.prior import log10_profile, prior_profile

    charts = {}
    for name, res in results.items():
        rho = res.profile.mean(axis=0)
        alpha = metrics[f"prior/{name}/alpha"]  # topology_metrics already fitted it; only the scale is left
        prior = prior_profile(len(rho), n_layers, alpha)
        prior = prior * 10 ** float(np.mean(log10_profile(rho) - log10_profile(prior)))
        # wandb type-checks every table row (~0.2 ms each): draw at most CHART_POINTS positions, ends kept.
        shown = np.unique(np.linspace(0, len(rho) - 1, min(len(rho), CHART_POINTS)).round().astype(int))
        x = (shown / max(len(rho) - 1, 1)).tolist()
        charts[f"jacobian/{name}/profile"] = wandb.plot.line_series(
            xs=x, ys=[np.log10(np.maximum(rho[shown], 1e-30)).tolist(), np.log10(prior[shown]).tolist()],
            keys=["measured", f"prior fit (a={alpha:.3f})"],
            title=f"log10 Jacobian profile, {name}, step {step}", xname="relative position (j-1)/(L-1)",
        )
    return charts


def run(cfg: TrainConfig, run_dir: Path) -> dict[str, float]:
    """Train as configured, writing everything into `run_dir`; returns the last logged metrics."""
    from analysis.jacobian import JacobianRecorder, build_eval_sequences, measure_sets
    from analysis.plots import (
        plot_depth_accuracy,
        plot_evolution,
        plot_heatmap,
        plot_position_accuracy,
        plot_profile_vs_prior,
    )
    from analysis.positional_eval import (
        ProbeResult,
        build_probes,
        evaluate_in2,
        evaluate_probes,
        write_eval_json,
    )
    from analysis.topology import prefixed, topology_metrics
    from data_builders.collate import BatchStream
    from data_builders.in2 import build_datasets
    from data_builders.tokenizer import load_tokenizer
    from models.build import build_model
    from models.checkpoint import (
        atomic_checkpoint,
        load_trainer_state,
        resolve_checkpoint,
        save_trainer_state,
    )
    from models.diff_attention import diff_lambda_stats, set_diff_step
    from models.distributed import DeepSpeedEngine, TorchEngine, all_mean, barrier, dist_info, resolve_device
    from models.peft_setup import apply_peft

    for key in ("plot_every", "chart_every"):  # cadences of measured steps; checked before any work
        if getattr(cfg.jacobian, key) < 1:
            raise ValueError(f"jacobian.{key}={getattr(cfg.jacobian, key)} must be >= 1")
    tcfg = cfg.trainer
    seed_everything(cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)

    # Data and tokenizer: the model's own tokenizer, or a BPE trained on the training corpus.
    tok_source = cfg.model.tokenizer or cfg.model.pretrained
    bundle = build_datasets(cfg.data, load_tokenizer(tok_source, cfg.model.trust_remote_code) if tok_source else None)
    tokenizer = bundle.tokenizer
    tokenizer.save_pretrained(run_dir / "tokenizer")

    model = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id)
    info = dist_info()
    if cfg.peft.method != "none" and not cfg.model.pretrained and info.is_main_process:
        # Adapters of a random-init model are useless without their base: keep it beside them.
        model.save_pretrained(run_dir / "base_model", safe_serialization=True)
    model = apply_peft(model, cfg.peft)
    model.train()

    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: warmup_cosine(s, tcfg.warmup_steps, tcfg.max_steps, tcfg.min_lr_ratio)
        )

    if tcfg.deepspeed:
        engine = DeepSpeedEngine(model, make_optimizer, make_scheduler, OmegaConf.to_container(tcfg.deepspeed)
                                 if OmegaConf.is_config(tcfg.deepspeed) else dict(tcfg.deepspeed),
                                 tcfg.precision, tcfg.micro_batch_size, tcfg.grad_accum, tcfg.grad_clip,
                                 tcfg.collective_timeout_s)
    elif info.world_size > 1:
        raise ValueError(f"{info.world_size} processes need a DeepSpeed trainer (trainer=zero2|zero3|zero3_offload)")
    else:
        model.to(resolve_device(tcfg.device))
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        engine = TorchEngine(model, optimizer, make_scheduler(optimizer), resolve_device(tcfg.device),
                             tcfg.precision, tcfg.grad_accum, tcfg.grad_clip)
    model, device = engine.module, engine.device
    # A curriculum lives in the split's stored order: the build's own setting (a prebuilt folder's too).
    curriculum = bundle.stats.get("config", {}).get("curriculum", 0.0)
    stream = BatchStream(bundle.train, tcfg.micro_batch_size, tokenizer.pad_token_id, cfg.seed, info.rank,
                         info.world_size, label_context=cfg.data.label_context, ordered_first_epoch=curriculum > 0)
    if info.is_main_process:
        print(f"global batch = {tcfg.micro_batch_size} micro x {tcfg.grad_accum} accumulation x "
              f"{info.world_size} ranks = {tcfg.micro_batch_size * tcfg.grad_accum * info.world_size} samples")

    start_step, ckpt = 0, None
    if tcfg.resume_from:
        ckpt = resolve_checkpoint(tcfg.resume_from, run_dir)
        engine.load(ckpt)
        state = load_trainer_state(ckpt, info.rank)
        start_step, stream.position = state["step"], state["stream_position"]
        print(f"resumed from {ckpt} at step {start_step}")

    main = info.is_main_process
    config_dict = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else vars(cfg)
    logger = MetricsLogger(cfg.logger, run_dir, config_dict) if main else NullLogger()
    n_layers = model.config.num_hidden_layers

    def save(step: int) -> Path:
        def write(folder: Path) -> None:
            engine.save(folder, tokenizer)
            save_trainer_state(folder, step, info.rank, {"stream_position": stream.position})

        return atomic_checkpoint(run_dir, step, write, tcfg.keep_last_n, main, barrier)

    # Jacobian sequences come from held-out documents, never from the training split.
    jac_on = cfg.jacobian.every > 0
    if jac_on:
        jac_seqs = build_eval_sequences(
            bundle.heldout_docs, cfg.jacobian.seq_len, cfg.jacobian.n_vanilla, cfg.jacobian.n_chunked,
            cfg.jacobian.chunk_len,
        )
        recorder = JacobianRecorder(
            run_dir / "jacobian.npz", {k: v.shape[0] for k, v in jac_seqs.items()}, cfg.jacobian.seq_len
        ) if main else None

    def measure_jacobian(step: int) -> dict[str, float]:
        # Every rank measures (ZeRO-3 gathers weights collectively); the main process records.
        results = measure_sets(model, {k: v.to(device) for k, v in jac_seqs.items()}, cfg.jacobian)
        metrics: dict[str, float] = {}
        for name, res in results.items():
            metrics.update(prefixed(topology_metrics(res.profile.mean(axis=0), n_layers), name))
        if recorder is not None:
            recorder.add(step, {k: r.profile for k, r in results.items()})
            n_measured = len(recorder.steps)
            if logger.wandb_run is not None:
                if (n_measured - 1) % cfg.jacobian.chart_every == 0:  # step 0, then every chart_every
                    logger.log_media(profile_charts(results, metrics, n_layers, step), step=step)
                if n_measured % cfg.jacobian.plot_every == 0:
                    logger.log_media({f"jacobian/{name}/heatmap": wandb_image(plot_heatmap(
                        run_dir / "jacobian.npz", run_dir / "plots" / f"jacobian_heatmap_{name}.png", name))
                        for name in results}, step=step)
        return metrics

    eval_records = bundle.eval.select(range(min(cfg.eval.num_examples, len(bundle.eval))))

    def depth_accuracy(step: int) -> dict[str, float]:
        metrics, result = evaluate_in2(model, tokenizer, eval_records, cfg.eval)
        if main:
            write_eval_json(run_dir, step, "in2", result)
        return metrics

    # Position probes (kv, mdqa, needle) every eval.probe_every steps, on fixed queries.
    probe_items = build_probes(cfg.eval, tokenizer) if cfg.eval.probes and cfg.eval.probe_every else {}

    def run_probes(step: int) -> dict[str, float]:
        probe_metrics, results = evaluate_probes(model, tokenizer, probe_items, cfg.eval)
        if main:
            for name, result in results.items():
                write_eval_json(run_dir, step, name, result)
                plot_position_accuracy({f"step {step}": result}, run_dir / "plots" / f"{name}_accuracy_step{step}.png",
                                       title=f"{cfg.exp_name}: {name} accuracy by gold position, step {step}")
        return probe_metrics

    # Accuracy by gold depth needs questions; language-model windows (micro100) have none.
    has_questions = cfg.data.format == "in2"
    accuracy_curves: dict[str, list[float]] = {}

    def depth_curve(metrics: dict[str, float]) -> list[float]:
        return [v for k, v in metrics.items() if "acc@" in k]

    if start_step == 0:
        acc0 = depth_accuracy(0) if has_questions else {}
        accuracy_curves["step 0"] = depth_curve(acc0)
        logger.log({**acc0, "eval/loss": heldout_loss(model, bundle.eval, tcfg.micro_batch_size,
                                                      tokenizer.pad_token_id, device)}, step=0)
    elif has_questions and main:
        # A resumed run keeps the start curve measured by the run that wrote the checkpoint, so its
        # accuracy plot still compares start and end; copied here when resuming into a new directory.
        step0 = ckpt.parents[1] / "eval" / "in2_step0.json"
        if step0.is_file():
            result = ProbeResult.load_json(step0)
            accuracy_curves["step 0"] = depth_curve(result.to_metrics("eval"))
            if not (run_dir / "eval" / step0.name).exists():
                write_eval_json(run_dir, 0, "in2", result)

    stop = StopRequest()
    bad_steps, metrics = 0, {}
    loop_start = time.perf_counter()
    batches = iter(stream)
    bar = tqdm(range(start_step, tcfg.max_steps), initial=start_step, total=tcfg.max_steps,
               disable=not main, desc="train", dynamic_ncols=True)
    step = start_step
    try:
        for step in bar:
            set_diff_step(model, step)
            if jac_on and step % cfg.jacobian.every == 0:
                # Logged at `step`, the updates its weights have seen: the row jacobian.npz and the charts use.
                logger.log(measure_jacobian(step), step=step)
            t0, tokens, losses = time.perf_counter(), 0, []
            for _ in range(tcfg.grad_accum):
                batch = next(batches)
                tokens += int(batch["attention_mask"].sum())
                losses.append(engine.forward_backward(batch))
            loss = all_mean(torch.stack(losses).mean().item())
            finite = math.isfinite(loss)
            grad_norm = engine.optimizer_step(skip=not finite)
            if not finite:
                bad_steps += 1
                if bad_steps > tcfg.max_bad_steps:
                    raise RuntimeError(
                        f"{bad_steps} non-finite losses (trainer.max_bad_steps={tcfg.max_bad_steps}); "
                        f"the last good checkpoint is intact under {run_dir / 'checkpoints'}"
                    )
            elapsed = time.perf_counter() - t0
            metrics = {
                "train/loss": loss, "train/lr": engine.current_lr(), "train/grad_norm": grad_norm,
                "train/tokens_per_s": tokens / elapsed, "train/tokens": tokens, "train/bad_steps": bad_steps,
                "train/wall_s": time.perf_counter() - loop_start,
                **diff_lambda_stats(model),
            }
            done = step + 1
            if cfg.eval.every and done % cfg.eval.every == 0:
                metrics["eval/loss"] = heldout_loss(model, bundle.eval, tcfg.micro_batch_size,
                                                    tokenizer.pad_token_id, device)
            if probe_items and done % cfg.eval.probe_every == 0:
                metrics.update(run_probes(done))
            logger.log(metrics, step=done)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}")
            if tcfg.save_every and done % tcfg.save_every == 0 and done < tcfg.max_steps:
                save(done)
            if stop.requested:
                print(f"stop requested: saving step {done} and exiting")
                save(done)
                if jac_on and main:
                    recorder.close()
                return metrics
    finally:
        stop.restore()
        bar.close()

    final = tcfg.max_steps
    if jac_on and final % cfg.jacobian.every == 0:
        # One more profile after the last update: the paper's (n, steps + 1, L) arrays.
        logger.log(measure_jacobian(final), step=final)
    acc = depth_accuracy(final) if has_questions else {}
    logger.log(acc, step=final)
    metrics.update(acc)
    save(final)
    if main:
        plots = run_dir / "plots"
        if has_questions:
            accuracy_curves[f"step {final}"] = depth_curve(acc)
            plot_depth_accuracy(accuracy_curves, plots / "in2_accuracy_by_depth.png",
                                title=f"{cfg.exp_name}: exact match by gold depth")
        if jac_on:
            recorder.close()  # jacobian.npz now holds every step on its own
            for name in jac_seqs:
                plot_evolution(run_dir / "jacobian.npz", plots / f"jacobian_evolution_{name}.png", name)
                if recorder.steps[0] == 0:
                    plot_profile_vs_prior(recorder.array(name)[:, 0].mean(axis=0), n_layers,
                                          plots / f"jacobian_step0_vs_prior_{name}.png",
                                          title=f"{cfg.exp_name}: step-0 Jacobian profile ({name}) and the prior")
    logger.close()
    return metrics


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg) -> None:
    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except Exception as exc:
        # With several ranks, say which one failed: the launcher interleaves their output.
        info = dist_info()
        if info.world_size > 1:
            print(f"[rank {info.rank} of {info.world_size}] {type(exc).__name__}: {exc}", file=sys.stderr)
        raise


def _strip_launcher_args() -> None:
    """`deepspeed` appends --local_rank=N, which Hydra would reject; LOCAL_RANK carries it too."""
    for arg in list(sys.argv[1:]):
        if arg.startswith("--local_rank"):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1] if "=" in arg else "0")
            sys.argv.remove(arg)


if __name__ == "__main__":
    _strip_launcher_args()
    main()
