"""Each torchrun rank's engine on its own GPU, shown without a GPU with vLLM's own classes (the CPU build shares this
code with the CUDA build the GPU requirements pin): under torchrun's RANK / LOCAL_RANK the in-process engine gets the
single-process executor, whose worker takes device 0 whatever LOCAL_RANK says; the GPU make_engine names (device_ids)
is the one vLLM's platform puts the worker on, with or without a scheduler's CUDA_VISIBLE_DEVICES.
bench.gpu_check checks the same on the GPUs themselves (each engine's worker device and memory)."""
import types

import pytest

from actobs import engine


class CudaLike:
    """vLLM's base platform with CUDA's device variable: the mapping a GPU worker applies to its device index."""

    @staticmethod
    def make():
        from vllm.platforms import interface

        class Platform(interface.Platform):
            device_control_env_var = "CUDA_VISIBLE_DEVICES"
        return Platform


def worker_gpu(vllm_config, assigned, platform):
    """The GPU index (as torch numbers them in the process) vLLM's worker of this config would set as its device: the
    executor's local rank, mapped through the physical GPUs assigned (device_ids resolved) and CUDA_VISIBLE_DEVICES.
    -> (the executor's name, that index)."""
    from vllm.platforms import interface
    from vllm.v1.executor.abstract import Executor
    executor = Executor.get_class(vllm_config)
    _, _, local_rank = executor._distributed_args(types.SimpleNamespace(vllm_config=vllm_config))
    interface._assigned_physical_gpu_ids = None  # process-wide in vLLM: a worker process sets it once
    try:
        if assigned:
            interface.set_assigned_physical_gpu_ids(assigned)
        return executor.__name__, platform.logical_device_id_to_visible_device_id(local_rank)
    finally:
        interface._assigned_physical_gpu_ids = None


@pytest.mark.parametrize("visible, gpu", [(None, 3), ("4,5,6,7", 3), ("5", 0)],
                         ids=["all GPUs, rank 3", "a scheduler's 4 GPUs, rank 3", "evaluate.py's one GPU"])
def test_the_engine_of_rank_n_runs_on_gpu_n(vllm_dir, monkeypatch, visible, gpu):
    import vllm.engine.arg_utils as arg_utils
    from vllm import EngineArgs, envs
    envs.disable_envs_cache()  # an engine made earlier in this process froze vLLM's reading of the environment
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("RANK", str(gpu))
    monkeypatch.setenv("LOCAL_RANK", str(gpu))
    monkeypatch.setenv("WORLD_SIZE", "8")
    kw = engine.engine_kwargs(vllm_dir, max_model_len=512, max_seqs=1, seed=0, dtype="fp32", gpu=gpu,
                              gpu_memory=0.35, kv_cache_gb=None, sleep=True)
    assert kw["device_ids"] == [gpu] and kw["enable_sleep_mode"]
    # the same arguments but for what this CPU build refuses (sleep mode, a GPU share) or needs (a KV size)
    cpu_kw = {k: v for k, v in kw.items() if k not in ("enable_sleep_mode", "gpu_memory_utilization")}
    made = EngineArgs(**cpu_kw, kv_cache_memory_bytes=2**24).create_engine_config()
    default = EngineArgs(**{k: v for k, v in cpu_kw.items() if k != "device_ids"},
                         kv_cache_memory_bytes=2**24).create_engine_config()
    platform = CudaLike.make()
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(arg_utils, "current_platform", platform)  # device_ids read as a CUDA build reads them
    assigned = EngineArgs(**cpu_kw)._resolve_device_ids()
    assert worker_gpu(made, assigned, platform) == ("UniProcExecutor", gpu)
    assert worker_gpu(default, None, platform) == ("UniProcExecutor", 0)  # without device_ids: GPU 0 for every rank
