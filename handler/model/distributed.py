"""Tensor-parallel ranks: layout, start-up, the step broadcast, the worker loop, shutdown.

Shape (degree N): rank 0 is the gunicorn worker process: HTTP threads, the engine loop with the
one scheduler, and sampling. Ranks 1..N-1 are child processes (`python -m handler.model.distributed
SPEC.json`) that rank 0 starts on loopback (MASTER_ADDR/MASTER_PORT); each loads the same model
sharded by transformers' tensor-parallel plan (`DistributedConfig(tp_size=N)`), so its attention
hook and its KV pool see only its own heads (H/N query heads, Hkv/N KV heads).

Every engine step rank 0 broadcasts the packed step (one int64 tensor, see `runner.pack_step`)
and all ranks run the same forward; the row-parallel layers all-reduce inside it and the LM head
gathers full logits, which only rank 0 samples from. The other ranks never see a request.

Failure rules: any rank exiting (or a collective failing) is fatal for the whole group: rank 0's
watcher reports one line and the server exits non-zero (a broken group cannot be repaired in
place). A child exits when rank 0 goes away (collective error or parent change). SIGTERM reaches
rank 0 only; once it has drained, rank 0 broadcasts STOP and waits for the children.

Pipeline parallelism across nodes would add a second mesh axis to `RankLayout` (pp x tp) and
send activations between stages; the step broadcast stays where it is (rank 0 -> all ranks).
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from handler.config import cpu_cores
from handler.config.switches import SWITCHES, switch

log = logging.getLogger("lmi.ranks")

STEP, STOP, PING = 1, 2, 3
DEFAULT_TIMEOUT_S = SWITCHES["LMI_TP_TIMEOUT_S"].default  # a collective (or start-up) taking longer fails the group
HEARTBEAT_S = 30.0              # idle ranks get a PING so their waiting broadcast never times out


class RankError(RuntimeError):
    """The rank group is broken (a rank died or a collective failed); str(e) is one line."""


def collective_timeout_s() -> float:
    return switch("LMI_TP_TIMEOUT_S")     # not a number: the default


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits. One tensor-parallel group spanning the world (no pipeline axis yet)."""
    rank: int
    world_size: int
    local_rank: int
    device_type: str            # "cpu" (gloo) | "cuda" (nccl, one rank per GPU)
    master_addr: str
    master_port: int

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def device_name(self) -> str:
        return f"cuda:{self.local_rank}" if self.device_type == "cuda" else "cpu"

    def env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank),
                "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


class Ranks:
    """One rank's membership: the process group, the step broadcast (rank 0 sends), collectives
    the runner needs. Rank 0's `group` (a RankGroup) watches and stops the children."""

    def __init__(self, layout: RankLayout, on_failure: Callable[[str], None] | None = None):
        self.layout = layout
        self.rank, self.world_size = layout.rank, layout.world_size
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = False
        self._failed = False

    def init(self, timeout_s: float | None = None) -> "Ranks":
        import torch
        import torch.distributed as dist

        os.environ.update(self.layout.env())
        if self.layout.device_type == "cpu":
            # The host's cores divided between the ranks (each rank's intra-op pool).
            torch.set_num_threads(max(1, cpu_cores() // self.world_size))
        else:
            torch.cuda.set_device(self.layout.local_rank)
        dist.init_process_group(
            self.layout.backend, init_method="env://", rank=self.rank, world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s or collective_timeout_s()),
            device_id=torch.device(self.layout.device_name) if self.layout.backend == "nccl" else None)
        return self

    @property
    def device(self):
        import torch
        return torch.device(self.layout.device_name)

    def min_across(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks: every pool must have the same size).
        Also the 'every rank has loaded' barrier."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- the step broadcast: header [cmd, n] then n int64 values
    def send_step(self, packed) -> None:
        """Rank 0: the other ranks run this packed step (runner.pack_step) on their shards."""
        self.send(STEP, packed)

    def check_supported(self, model_dir: str, trust_remote_code: bool = False) -> None:
        check_supported(model_dir, self.world_size, trust_remote_code)

    def send(self, cmd: int, body=None) -> None:
        import torch
        import torch.distributed as dist

        with self._lock:
            if self._closed:
                raise RankError("the tensor-parallel ranks are stopped")
            n = 0 if body is None else body.numel()
            try:
                dist.broadcast(torch.tensor([cmd, n], dtype=torch.int64, device=self.device), src=0)
                if n:
                    dist.broadcast(body.to(self.device), src=0)
            except Exception as e:
                self.fail(f"rank 0: step broadcast failed: {type(e).__name__}: {_first_line(e)}")
                raise RankError(str(e)) from None
            self._last_send = time.monotonic()

    def recv(self):
        """(cmd, CPU int64 body or None), as rank 0 sent it."""
        import torch
        import torch.distributed as dist

        h = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(h, src=0)
        cmd, n = h.tolist()
        if not n:
            return cmd, None
        body = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(body, src=0)
        return cmd, body.cpu()

    def fail(self, message: str) -> None:
        """A collective failed or a rank died: the group is broken for good."""
        if not self._failed:
            self._failed = True
            log.error("tensor parallel group failed: %s", message)
            if self.on_failure is not None:
                self.on_failure(message)

    def start_heartbeat(self) -> None:
        def beat():
            while not self._closed:
                time.sleep(HEARTBEAT_S / 4)
                if time.monotonic() - self._last_send > HEARTBEAT_S and self._lock.acquire(blocking=False):
                    self._lock.release()
                    try:
                        self.send(PING)
                    except RankError:
                        return
        threading.Thread(target=beat, name="lmi-tp-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """Rank 0: tell the other ranks to exit (after the engine has drained)."""
        if self._closed:
            return
        if not self._failed and self._lock.acquire(timeout=30):
            self._lock.release()
            try:
                self.send(STOP)
            except RankError:
                pass
        self._closed = True


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _signal_name(num: int) -> str:
    import signal
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_supported(model_dir: str, degree: int, trust_remote_code: bool = False) -> None:
    """Refuse, in one line, an architecture that transformers has no tensor-parallel plan for."""
    from transformers import AutoConfig

    from handler.model.runner import ModelLoadError
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {type(e).__name__}: {e}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "base_model_tp_plan", None):
        arch = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise ModelLoadError(
            f"option.tensor_parallel_degree={degree}: {arch} ({config.model_type}) has no tensor-parallel "
            f"plan in transformers, so it cannot be sharded; serve it with option.tensor_parallel_degree=1 "
            f"(families with a plan include Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo-2, GPT-NeoX)")


class RankGroup:
    """Rank 0's side: start ranks 1..N-1 as child processes, watch them, stop them."""

    def __init__(self, degree: int, device_type: str, runner_kwargs: dict,
                 on_failure: Callable[[str], None]):
        self.degree = degree
        self.on_failure = on_failure
        addr = switch("LMI_TP_MASTER_ADDR")
        port = int(switch("LMI_TP_MASTER_PORT") or free_port())
        self.layout = RankLayout(0, degree, 0, device_type, addr, port)
        self.ranks = Ranks(self.layout, on_failure=self._failed)
        self.procs: dict[int, subprocess.Popen] = {}
        self._dir = tempfile.mkdtemp(prefix="lmi-ranks-")
        self._stopping = False
        self._runner_kwargs = runner_kwargs
        self.failure: str | None = None

    def _failed(self, message: str) -> None:
        if not self._stopping:
            self._stopping = True
            self.failure = message
            self.on_failure(message)

    def wait_failure(self, timeout: float) -> str | None:
        """The group's failure line once the watcher has seen one (None after `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.failure

    def spawn(self) -> "RankGroup":
        """Start ranks 1..N-1 (they import and load while rank 0 goes on)."""
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        for r in range(1, self.degree):
            layout = RankLayout(r, self.degree, r, self.layout.device_type,
                                self.layout.master_addr, self.layout.master_port)
            spec = os.path.join(self._dir, f"rank{r}.json")
            with open(spec, "w") as f:
                json.dump({"layout": asdict(layout), "runner": self._runner_kwargs,
                           "status": self._status_path(r), "parent": os.getpid(),
                           "timeout_s": collective_timeout_s()}, f)
            self.procs[r] = subprocess.Popen([sys.executable, "-m", "handler.model.distributed", spec],
                                             env=env, stdin=subprocess.DEVNULL)
            log.info("tensor parallel: rank %d/%d started (pid %d, %s)", r, self.degree,
                     self.procs[r].pid, self.layout.backend)
        threading.Thread(target=self._watch, name="lmi-tp-watch", daemon=True).start()
        atexit.register(self.stop)
        return self

    def join(self) -> Ranks:
        """Join the process group as rank 0 (blocks until every rank has joined)."""
        return self.ranks.init()

    def _status_path(self, r: int) -> str:
        return os.path.join(self._dir, f"rank{r}.status")

    def _watch(self) -> None:
        while not self._stopping:
            for r, p in self.procs.items():
                rc = p.poll()
                if rc is not None and not self._stopping:
                    try:
                        with open(self._status_path(r)) as f:
                            why = f.read().strip()
                    except OSError:
                        why = ""
                    if not why:
                        how = f"was killed by {_signal_name(-rc)}" if rc < 0 else f"exited with code {rc}"
                        why = f"rank {r} (pid {p.pid}) {how}"
                    self.ranks.fail(why)
                    return
            time.sleep(0.2)

    def stop(self, timeout: float = 20.0, graceful: bool = True) -> None:
        """After the engine has drained: STOP to every rank, wait, kill what is left. Not
        graceful (start-up failed: the ranks may sit in another collective): kill them."""
        if not self.procs:
            return
        failed = self._stopping
        self._stopping = True
        if not graceful:
            timeout = 0.0
        elif not failed:
            self.ranks.stop()
        deadline = time.monotonic() + timeout
        for r, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d (pid %d) did not stop in %.0f s; killing it", r, p.pid, timeout)
                p.kill()
                p.wait()
        self.procs = {}
        log.info("tensor parallel: all ranks stopped")


# ---------------------------------------------------------------------------- ranks 1..N-1
def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            log.error("rank 0 (pid %d) is gone; exiting", parent)
            os._exit(1)
        time.sleep(0.5)


def worker_main(spec_path: str) -> int:
    import signal

    with open(spec_path) as f:
        spec = json.load(f)
    layout = RankLayout(**spec["layout"])
    logging.basicConfig(level=switch("LMI_LOG_LEVEL"),
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {layout.rank}]: %(message)s")
    # SIGTERM/SIGINT go to rank 0, which drains and then sends STOP; a signal to the whole
    # process group must not pull a rank out from under a draining rank 0.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec["parent"],), daemon=True).start()

    def die(message: str) -> int:
        line = f"rank {layout.rank}: {message}"
        try:
            with open(spec["status"], "w") as f:
                f.write(line)
        except OSError:
            pass
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 1

    try:
        ranks = Ranks(layout).init(spec["timeout_s"])
        from handler.model.runner import ModelRunner
        runner = ModelRunner(**spec["runner"], ranks=ranks)
    except Exception as e:
        log.debug("rank start-up failed", exc_info=True)
        return die(_first_line(e) if type(e).__name__ == "ModelLoadError"
                   else f"{type(e).__name__}: {_first_line(e)}")
    log.info("rank %d/%d ready", layout.rank, layout.world_size)
    try:
        while True:
            cmd, body = ranks.recv()
            if cmd == STEP:
                runner.forward(body)
            elif cmd == STOP:
                break
    except Exception as e:
        return die(f"step failed: {type(e).__name__}: {_first_line(e)}")
    log.info("rank %d stopped", layout.rank)
    logging.shutdown()
    os._exit(0)     # skip interpreter teardown (seconds of torch/gloo destructors); nothing to flush


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
