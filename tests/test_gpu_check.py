"""bench.gpu_check's reading of where a run's processes held GPU memory (what it cannot run here, it reads from
nvidia-smi on a GPU node): a run passes with each of its processes on one GPU and the GPUs it should use all in use."""
from bench import gpu_check

GPUS = [(0, "GPU-a", "H100"), (1, "GPU-b", "H100")]


class Seen(gpu_check.GPUWatch):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen


def test_each_process_on_its_own_gpu_passes():
    ok, detail = gpu_check.placement(Seen({11: {"GPU-a": 900}, 12: {"GPU-b": 800}, 99: {"GPU-a": 5}}), {11, 12}, 2,
                                     GPUS)
    assert ok and detail == "2 processes on 2 GPUs (gpu 0: 900 MiB, gpu 1: 800 MiB)"


def test_a_process_on_two_gpus_or_a_gpu_left_idle_fails():
    assert gpu_check.placement(Seen({11: {"GPU-a": 900, "GPU-b": 300}, 12: {"GPU-b": 800}}), {11, 12}, 2, GPUS) == (
        False, "2 processes on 2 GPUs (gpu 0: 900 MiB, gpu 1: 800 MiB); on two GPUs: {11: ['GPU-a', 'GPU-b']}")
    assert not gpu_check.placement(Seen({11: {"GPU-a": 900}, 12: {"GPU-a": 800}}), {11, 12}, 2, GPUS)[0]


def test_a_run_nvidia_smi_never_saw_fails():
    ok, detail = gpu_check.placement(Seen({99: {"GPU-a": 5}}), {11, 12}, 2, GPUS)
    assert not ok and "none of the run's processes" in detail
