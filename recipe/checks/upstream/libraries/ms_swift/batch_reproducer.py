"""The reproducer of ms-swift's batch path (collator, prepare_batch, get_batch_on_this_cp_rank
on mcore-bridge's split), as real code shipped by `inspect.getsource` after the prelude and
the shared parts of `reproducers.py`."""

from __future__ import annotations

import os
import sys
import types

from recipe.checks.upstream.kit.checked import entry_points
from recipe.checks.upstream.libraries.ms_swift.reproducers import (
    COMMON,
    SPLIT_TRUTH,
    logger,
    megatron_stand_in,
    script,
)
from recipe.parallel.cp.contract import unique_sequences
from recipe.upstream.prelude import fetch_wheel, load_from_wheel
from recipe.upstream.releases import ParallelStateStandIn


def load_swift_path(wheel, bridge_wheel):
    """ms-swift's files of the batch path from its wheel, on mcore-bridge's split."""
    none = {}
    npu = {"is_torch_npu_available": lambda: False}
    with megatron_stand_in():
        bridge = load_from_wheel(
            bridge_wheel,
            "mcore_bridge/utils/megatron_utils.py",
            {"transformers": none, "mcore_bridge.utils.logger": {"get_logger": logger}},
            package="mcore_bridge.utils",
        )
        params_stubs = {
            "transformers": none,
            "transformers.integrations": none,
            "transformers.trainer_utils": none,
            "swift.utils.logger": {"get_logger": logger},
            "swift.utils.utils": none,
        }
        params = load_from_wheel(
            wheel, "swift/utils/transformers_utils.py", params_stubs, package="swift.utils"
        )
        utils_stubs = {
            "transformers": none,
            "transformers.utils": npu,
            "swift": none,
            "swift.tuners": none,
            "swift.utils": {
                "get_logger": logger,
                "get_packed_seq_params": params.get_packed_seq_params,
            },
        }
        utils = load_from_wheel(
            wheel, "swift/megatron/utils/utils.py", utils_stubs, package="swift.megatron.utils"
        )
        packages = {"swift": none, "swift.megatron": none, "swift.megatron.utils": none}
        split_stubs = {
            **packages,
            "mcore_bridge": {"split_cp_inputs": bridge.split_cp_inputs},
            "transformers": none,
            "transformers.utils": npu,
            "swift.utils": {"get_logger": logger},
            "swift.megatron.utils.megatron_fsdp_checkpoint": none,
            "swift.megatron.utils.patcher": none,
        }
        split = load_from_wheel(
            wheel,
            "swift/megatron/utils/megatron_lm_utils.py",
            split_stubs,
            package="swift.megatron.utils",
        )
        trainer_stubs = {
            **packages,
            "accelerate": none,
            "accelerate.utils": none,
            "swift.dataloader": none,
            "swift.megatron.utils": {
                "get_batch_on_this_cp_rank": split.get_batch_on_this_cp_rank,
                "get_packed_seq_params": utils.get_packed_seq_params,
            },
            "swift.utils": {
                "get_logger": logger,
                "to_device": lambda data, *a, **k: data,
                "get_current_device": lambda: "cpu",
            },
        }
        trainer = load_from_wheel(
            wheel, "swift/megatron/trainers/utils.py", trainer_stubs,
            package="swift.megatron.trainers",
        )  # fmt: skip
        collator_stubs = {
            "modelscope": none,
            "modelscope.hub": none,
            "modelscope.hub.utils": none,
            "modelscope.hub.utils.utils": none,
            "peft": none,
            "PIL": {"Image": types.SimpleNamespace(Image=object)},
            "transformers": none,
            "transformers.integrations": none,
            "transformers.utils": none,
            "swift": none,
            "swift.utils": {
                "get_logger": logger,
                "retry_decorator": lambda *a, **k: lambda function: function,
            },
            "swift.template": none,
            "swift.template.template_inputs": none,
            "swift.template.utils": none,
            "swift.template.vision_utils": none,
        }
        collator = load_from_wheel(
            wheel, "swift/template/base.py", collator_stubs, package="swift.template"
        )
    return bridge, utils, split, trainer, collator


def batch_outputs(wheel, bridge_version, case, o):
    """Each rank's labels, positions, weights (and tokens) after ms-swift's collator and
    prepare_batch, `o` the options. The mcore-bridge wheel: $MCORE_BRIDGE_WHEEL, else pip
    download."""
    bridge_wheel = os.environ.get("MCORE_BRIDGE_WHEEL") or fetch_wheel(
        "mcore-bridge", bridge_version
    )
    bridge, utils, split, trainer, collator = load_swift_path(wheel, bridge_wheel)
    cp, tp = case["cp"], case["tp"]
    args = types.SimpleNamespace(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=1,
        sequence_parallel=o["sequence_parallel"],
        fp8_format=o["fp8_format"],
        fp8=o["fp8_format"],
        fp4_format=o["fp4_format"],
        fp4=o["fp4_format"],
        fp8_recipe=o["fp8_recipe"],
        attention_backend=o["attention_backend"],
        task_type="causal_lm",
        padding_free=o["padding_free"],
        is_multimodal=o["is_multimodal"],
        cp_partition_mode=o["cp_partition_mode"],
    )
    seqs = unique_sequences(case["lengths"])
    outputs = {"ranks": []}
    # asked at call time
    sys.modules["transformers.utils"] = types.SimpleNamespace(is_torch_npu_available=lambda: False)
    for rank in range(cp):
        template = collator.Template.__new__(collator.Template)
        vars(template).update(
            tokenizer=types.SimpleNamespace(pad_token_id=0),
            padding_side=o["padding_side"],
            mode="train",
            use_megatron=True,
            padding_free=o["padding_free"],
            sequence_parallel_size=cp,
        )
        samples = []
        for tokens in seqs:  # what Template.encode gives the collator for training
            sample = {
                "input_ids": list(tokens),
                "labels": [-100, *tokens[1:]],
                "length": len(tokens),
            }
            if o["loss_scale"]:
                sample["loss_scale"] = [0.0] + [1.0] * (len(tokens) - 1)
            samples.append(sample)
        data = template._data_collator(samples, padding_to=utils.get_padding_to(args))
        rows, width = data["input_ids"].shape
        bridge.mpu = split.mpu = trainer.mpu = ParallelStateStandIn(cp, rank, tp)
        batch = trainer.prepare_batch(args, data)
        labels = batch["labels"].reshape(-1)
        weight = (labels != -100).double()
        if batch.get("loss_scale") is not None:
            weight = weight * batch["loss_scale"].reshape(-1).double()
        got = {
            "position_ids": batch["position_ids"].reshape(-1).tolist(),
            "labels": labels.tolist(),
            "loss_mask": weight.tolist(),
        }
        if not o["is_multimodal"]:
            got["input_ids"] = batch["input_ids"].reshape(-1).tolist()
        outputs["ranks"].append(got)
        psp = batch.get("packed_seq_params")
        n = len(seqs)
        outputs["layout"] = (
            [k * width for k in range(n + 1)]
            if psp is None
            else [int(c) for c in psp.cu_seqlens_q[: n + 1]]
        )
        outputs["rows"], outputs["width"] = rows, width
    return outputs


def batch_body(defaults: dict, bridge_version: str) -> str:
    return script(
        (*COMMON, *SPLIT_TRUTH, load_swift_path, batch_outputs),
        {"DEFAULTS": defaults, "BRIDGE_VERSION": bridge_version},
        entry_points(
            "batch_outputs(wheel, BRIDGE_VERSION, CASE, {**DEFAULTS, **OPTIONS})",
            "split_problems(outputs, CASE, OPTIONS)",
        ),
    )
