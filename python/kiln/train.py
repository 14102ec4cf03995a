"""kiln.train: the common training loop over a compiled step, with a progress bar (tqdm where
installed, else a line every log_every steps) and metrics. Ctrl-C stops it cleanly after the
step in flight: the step (and the module it trains) stays consistent, and the result says so."""
import math
import time
from dataclasses import dataclass, field

from . import _kiln
from .step import Step, compile


@dataclass
class TrainResult:
    step: Step                     # the compiled step (continue with it, save it, report it)
    steps_done: int = 0            # steps this call ran
    losses: list = field(default_factory=list)  # one float per step
    seconds: float = 0.0           # the loop's wall time (the compile excluded)
    compile_seconds: float = 0.0
    samples_per_second: float = 0.0
    skipped_batches: int = 0       # batches whose shapes differ from the step's (a short last batch)
    interrupted: bool = False      # stopped by Ctrl-C

    @property
    def final_loss(self):
        return self.losses[-1] if self.losses else math.nan


def _batches(data, repeat):
    """Batches from `data`; with `repeat`, starting over when an iterable that can be iterated
    again ends."""
    while True:
        iterator = iter(data)
        empty = True
        for batch in iterator:
            empty = False
            yield batch if isinstance(batch, (tuple, list)) else (batch,)
        if empty or iterator is data or not repeat:
            return


def _shapes(batch):
    return [tuple(getattr(x, "shape", ())) for x in batch]


def train(model, data, steps=None, *, loss=None, optimizer=None, device="cpu", amp="off", log_every=10,
          progress=True, checkpoint=None, **compile_options):
    """Trains `model` (a torch module, an ONNX file's path, or a kiln.Step) on the batches of
    `data` (an iterable of tuples of tensors, such as a torch DataLoader; started over until
    `steps` steps have run, or once through without `steps`). The first batch is the example
    the step is compiled for; batches of other shapes (a short last batch) are skipped and
    counted. Losses are read from the device every `log_every` steps (one wait each).
    `checkpoint`: a path the step is saved to at the end (and when stopped by Ctrl-C).
    The other options are kiln.compile's (shard=: every rank runs this with its own rows of each
    batch; rank 0 shows the progress). Returns a TrainResult."""
    batches = _batches(data, repeat=steps is not None)
    result, bar = None, None
    start, samples = time.perf_counter(), 0
    try:
        first = next(batches, None)
        if first is None:
            raise _kiln.Error("train: the data gave no batch")
        if isinstance(model, Step):
            step = model
            if compile_options or loss is not None or optimizer is not None:
                raise _kiln.Error("train: a compiled kiln.Step takes no compile options")
        else:
            step = compile(model, first, loss=loss, optimizer=optimizer, device=device, amp=amp, **compile_options)
        result = TrainResult(step=step, compile_seconds=step._session.compile_seconds)
        progress = progress and step.rank == 0  # in a group, rank 0 shows it (every rank's loss is the global mean)
        shapes = _shapes(first)
        bar = _progress(steps, progress)
        start = time.perf_counter()
        pending = 0
        batch = first
        while steps is None or result.steps_done < steps:
            if _shapes(batch) != shapes:
                result.skipped_batches += 1
            else:
                step(*batch)
                result.steps_done += 1
                pending += 1
                samples += shapes[0][0] if shapes[0] else 1
                if pending == log_every:
                    _log(result, step, bar, pending, samples, start)
                    pending = 0
            batch = next(batches, None)
            if batch is None:
                break
        if pending:
            _log(result, step, bar, pending, samples, start)
    except KeyboardInterrupt:
        if result is None:
            raise
        result.interrupted = True
        result.losses += result.step.losses()  # waits for the step in flight
    finally:
        if bar is not None:
            bar.close()
    if result.interrupted:
        print(f"kiln.train: stopped by Ctrl-C after {result.steps_done} steps")
    result.seconds = time.perf_counter() - start
    result.samples_per_second = samples / result.seconds if result.seconds > 0 else 0.0
    if checkpoint is not None:
        result.step.save(checkpoint)
    if result.step._gathered:  # zero3: the module's params take the trained values (a gather)
        result.step.state_dict()
    if progress:
        print(f"kiln.train: {result.steps_done} steps in {result.seconds:.2f} s "
              f"({result.samples_per_second:.0f} samples/s), loss {result.final_loss:.4f}")
    return result


def _log(result, step, bar, count, samples, start):
    """Reads the losses of the last `count` steps (one wait) and shows them."""
    losses = step.losses()
    result.losses += losses
    if losses and not all(math.isfinite(x) for x in losses):
        bad = result.steps_done - len(losses) + next(i for i, x in enumerate(losses) if not math.isfinite(x))
        raise _kiln.Error(f"train: the loss is {losses[-1]} at step {bad + 1}")
    seconds = time.perf_counter() - start
    metrics = {"loss": f"{losses[-1]:.4f}", "lr": f"{step.lr:.3g}", "samples/s": f"{samples / seconds:.0f}"}
    if bar is not None:
        bar.update(count)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(metrics, refresh=False)


def _progress(steps, progress):
    """tqdm's bar where installed, else a plain line per log call; None when progress is off."""
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
        return tqdm(total=steps, unit="step", desc="kiln.train")
    except ImportError:
        return _Lines(steps)


class _Lines:
    """The progress as plain lines, without tqdm."""

    def __init__(self, total):
        self.total, self.done = total, 0

    def update(self, count):
        self.done += count

    def set_postfix(self, metrics, refresh=False):
        shown = ", ".join(f"{k} {v}" for k, v in metrics.items())
        print(f"kiln.train: step {self.done}{f'/{self.total}' if self.total else ''}: {shown}", flush=True)

    def close(self):
        pass
