"""The torch reference executor: a small MoE transformer, paged KV cache and engine loop.

Needs the ``executor`` extra (torch). The torch-free parts -- EPLB placement
(:mod:`~llmsched.executor.eplb`), wide-EP sizing and the dual-batch-overlap cost term
(:mod:`~llmsched.executor.sizing`) and the step-time profile (:mod:`~llmsched.executor.step_time`)
-- import without torch; the names below that need torch load on first use.

>>> from llmsched.executor import Engine, EngineConfig, ModelConfig, MoETransformer, SamplingParams
>>> engine = Engine(MoETransformer(ModelConfig()), EngineConfig(num_blocks=8))
>>> len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0])
2
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmsched.executor.config import DEFAULT_BLOCK_SIZE, EngineConfig, ModelConfig
from llmsched.executor.eplb import ExpertPlacement, gpu_loads, imbalance, rebalance_experts
from llmsched.executor.sizing import (
    KVSizing,
    MoEModelSpec,
    ParallelLayout,
    dbo_step_time,
    kv_tokens_per_rank,
)
from llmsched.executor.step_time import StepSample, StepTimeProfile

if TYPE_CHECKING:
    from llmsched.executor.calibrate import CalibrationGrid, calibrate
    from llmsched.executor.engine import Engine, EngineMetrics, RequestOutput, SamplingParams
    from llmsched.executor.expert_parallel import AllToAllExperts, launch, run_until_done
    from llmsched.executor.kv_cache import BlockPool, KVCacheManager
    from llmsched.executor.model import LocalExperts, MoETransformer, PagedKV
    from llmsched.executor.rebalance import ExpertRebalancer, RebalanceStats

_TORCH_NAMES = {
    "CalibrationGrid": "calibrate",
    "calibrate": "calibrate",
    "Engine": "engine",
    "EngineMetrics": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "engine",
    "AllToAllExperts": "expert_parallel",
    "launch": "expert_parallel",
    "run_until_done": "expert_parallel",
    "BlockPool": "kv_cache",
    "KVCacheManager": "kv_cache",
    "LocalExperts": "model",
    "MoETransformer": "model",
    "PagedKV": "model",
    "ExpertRebalancer": "rebalance",
    "RebalanceStats": "rebalance",
}

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "AllToAllExperts",
    "BlockPool",
    "CalibrationGrid",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "ExpertPlacement",
    "ExpertRebalancer",
    "KVCacheManager",
    "KVSizing",
    "LocalExperts",
    "MoEModelSpec",
    "MoETransformer",
    "ModelConfig",
    "PagedKV",
    "ParallelLayout",
    "RebalanceStats",
    "RequestOutput",
    "SamplingParams",
    "StepSample",
    "StepTimeProfile",
    "calibrate",
    "dbo_step_time",
    "gpu_loads",
    "imbalance",
    "kv_tokens_per_rank",
    "launch",
    "rebalance_experts",
    "run_until_done",
]


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'llmsched.executor' has no attribute {name!r}")
    # The torch modules check for the extra themselves and raise ImportError naming it.
    loaded = importlib.import_module(f"llmsched.executor.{module}")
    return getattr(loaded, name)
