"""The 2024-26 published memory rows (benchmarks/data/published_memory_2026.csv: ms-swift's
DeepSpeed, Megatron and MoE runs, axolotl's new architectures and MoE, PEFT's DeepSpeed ZeRO-3 and
FSDP 70B runs, torchtitan's H100 FSDP table) written as specs, for benchmarks/plan_accuracy.py.

Each row's settings are read off its source (the CSV's notes and the trainer's shipped config:
ms-swift swift/llm/ds_config/zero2.json @054575c6 and zero3.json @35992c1c; the accelerate/HF
"auto" buckets for PEFT's ZeRO-3 runs). Where a row's source leaves something open the choice
is made here once, before planning, and said:
  - the figure's kind: ms-swift's docs and axolotl's READMEs quote the trainer's own log line
    (ms-swift: memory(GiB) = max_memory_reserved; axolotl: device_mem_reserved(gib)) - read as
    reserved GiB where the text writes "GB"; PEFT's figures are read off a GPU-memory chart
    (device level, GiB as nvidia-smi counts);
  - "<=2048 (max_length, unpacked)" rows: the longest sample of the batch at the peak is not
    published; they are planned at max_length and marked (left out of the like-for-like median);
  - Megatron-LM rows: model.implementation megatron with its distributed optimizer written as
    ZeRO stage 1, which the plan holds as Megatron's (6 + 12/d bytes per parameter: the fp32
    main-grad buffer whole and kept between steps, fp32 main parameters and Adam state sharded
    over the data-parallel ranks; Megatron Core docs, Distributed Optimizer).
"""

from __future__ import annotations

# ms-swift swift/llm/ds_config/zero2.json @054575c6: overlap_comm, 2e8-element buckets (its
# "optimizer" block, DeepSpeed's FusedAdam, went in e471074f on 2024-12-26: HF Trainer's AdamW
# after that; overlap_comm false from e5c4c39e, 2025-03-24)
SWIFT_Z2 = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 200_000_000,
            "allgather_bucket_size": 200_000_000, "contiguous_gradients": True}
# ms-swift zero3.json @35992c1c: overlap_comm, HF's auto buckets, 1e9 live / reuse / sub-group
SWIFT_Z3 = {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000, "sub_group_size": 1_000_000_000}
# the same file from e5c4c39e (2025-03-24) to the v4 refactor (67ae6076, 2026-01-14): overlap_comm
# false - what ms2's (2025-06-19) and ms6's (2025-04-29) figures ran with
SWIFT_Z3_2025 = dict(SWIFT_Z3, overlap_comm=False)
# HF Trainer's default optim, adamw_torch: torch's AdamW with its foreach default (one sub-group-
# or parameter-sized temporary at the step). transformers defaults to adamw_torch_fused only on
# PyTorch >= 2.8 (PR #37358, merged 2025-07), after every ms-swift figure here.
HF_ADAMW = {"name": "adamw", "impl": "foreach"}
# DeepSpeed's FusedAdam (a ds_config "optimizer" block: ms-swift's zero2/zero3.json before
# e471074f, 2024-12-26) and Megatron's fused Adam: no step temporary
FUSED_ADAMW = {"name": "adamw", "impl": "fused"}
# ms-swift's LoRA defaults to lora_dropout 0.05 (swift/llm/argument/tuner_args.py @7ef82cde5,
# swift/arguments/tuner_args.py and megatron_args.py @3602360a); its scripts do not set it
SWIFT_LORA = {"kind": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_dropout": 0.05,
              "lora_targets": "all-linear"}
SWIFT = {"precision": "bf16-mixed", "activation_checkpointing": "full", "optimizer": HF_ADAMW}
MEGATRON = {"model_implementation": "megatron", "optimizer": FUSED_ADAMW}
FLASH = {"attention": "flash-attention-2"}
LIGER = {"attention": "flash-attention-2",
         "liger": ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]}
# axolotl's QLoRA examples: r32 alpha16 dropout 0.05 on q,k,v,o,gate,up,down, double quant,
# bf16 auto (bf16 base, fp32 adapters under autocast), flash attention, Cut Cross-Entropy
AX_QLORA = {"kind": "qlora", "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.05,
            "double_quant": True,
            "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"]}
AX = {"precision": "bf16-mixed", "activation_checkpointing": "full", "sequence_length": 2048,
      "micro_batch_size": 2, "kernels": {"attention": "flash-attention-2",
                                         "cut_cross_entropy": True}}
GPT_OSS_ATTN = {"kind": "lora", "lora_rank": 8, "lora_alpha": 16,
                "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
PE_LORA = {"kind": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.1,
           "lora_targets": "all-linear"}
# PEFT's docs of 2024-02-26 / 2024-03-13 ran a transformers before 4.46 (4.38 was the newest
# release then): the forward upcast the logits to fp32 in its output (HF Trainer drops it)
PE_HF = {"model_transformers_version": "4.38"}
# PEFT's DeepSpeed runs: accelerate's deepspeed_config.yaml (no json) builds a ds config of the
# stage and offload devices only (accelerate DeepSpeedPlugin), no bucket key set to 'auto':
# DeepSpeed's defaults (reduce 5e8, prefetch 5e7, persistence 1e5, max live 1e9)
PE_Z3 = {"stage": 3}
TT = {"method": {"kind": "full"}, "precision": "bf16-mixed", "sequence_length": 8192,
      "micro_batch_size": 2, "activation_checkpointing": "selective-op",
      "optimizer": {"name": "adamw", "impl": "fused"}, "model_implementation": "torchtitan"}
MAX_LEN = "peak sample length not published (planned at max_length 2048)"
# ms-swift's dataset table (docs/source_en/Instruction/Supported-models-and-datasets.md @3602360a,
# 'Statistic (token)': each dataset encoded with Qwen2.5-7B-Instruct's template by
# scripts/utils/run_dataset_info.py): swift/self-cognition 108 rows, 58.9+-20.3, min=32, max=131;
# AI-ModelScope/alpaca-gpt4-data-en 52,002 rows, 167.6+-123.9, max=607; alpaca-gpt4-data-zh 48,818
# rows, 157.2+-93.2, max=544. A draw of '#1000' from self-cognition's 108 rows takes every row,
# its longest included; a draw of '#500' from alpaca may stop short of the set's longest.
SELF_COGNITION_MAX = 131
ALPACA_MAX = 607
DATA_MAX = ("peak sample length not published: planned at the longest sample of its datasets "
            "(ms-swift's dataset table: alpaca-gpt4-data-en, 607 tokens), which its 500-row "
            "draws may not reach")
LENGTH_BOUNDS = (MAX_LEN, DATA_MAX)  # planned at an upper bound of the run's longest sample
# The Megatron scripts whose figure first appeared with PYTORCH_CUDA_ALLOC_CONF=
# 'expandable_segments:True' in the same file (ms-swift ea766ff5, 2025-07-10: lora/dense.sh and
# lora/moe.sh). ms5's figure (base_to_chat.sh, 9d297f99, 2025-03-21) and ms8's
# (moe/qwen3_moe_offload.sh, 5712d6af, 2025-06-30) were written before their scripts set it
# (5df8180f, 2025-07-03, added it to both, the comments unchanged): planned without.
EXPANDABLE = {"allocator": {"expandable_segments": True}}
# transformers < 5 ran routed experts as a Python loop over the experts a batch hits (per-expert
# modules, gpt-oss's training path, axolotl's linearized Llama 4 experts)
LOOP = {"implementation": "eager"}
# shisa-ai's Qwen3-30B-A3B SFT on 8 x MI300X: axolotl, DeepSpeed zero3_bf16.json (no live or
# reused parameters kept: stage3_max_live_parameters / max_reuse_distance 0), packed 8192;
# val_set_size 0: no validation pass
SHISA = {"method": {"kind": "full"}, "precision": "bf16-mixed", "sequence_length": 8192,
         "validation": {"enabled": False},
         "activation_checkpointing": "full", "optimizer": {"name": "adamw_8bit_torchao"},
         "kernels": LIGER,
         "parallel": {"strategy": "deepspeed", "devices": 8,
                      "deepspeed": {"stage": 3, "overlap_comm": True,
                                    "stage3_max_live_parameters": 0,
                                    "stage3_max_reuse_distance": 0}}}
SHISA_NOTE = ("an informal, rounded device-level figure ('about N GB VRAM'; the meter is not "
              "stated); the transformers version, and so the MoE layout and experts "
              "implementation, not stated (planned with the installed transformers')")
# axolotl's linearized Llama 4 checkpoint (llama4_linearized_experts: true): each expert an
# nn.Linear, which QLoRA quantizes to NF4; its loop runs every expert on every token, as
# transformers' fused Llama 4 does
LINEARIZED = dict(LOOP, experts_layout="per_expert")

ROWS_2026: dict[str, tuple[str, dict, list[str]]] = {
    "ms1": ("qwen3-8b", dict(SWIFT, method=SWIFT_LORA), [MAX_LEN]),
    "ms2": ("qwen3-8b", dict(SWIFT, method={"kind": "full"}, sequence_length=8192,
                             gradient_accumulation_steps=4, kernels=LIGER,
                             parallel={"strategy": "deepspeed", "devices": 4,
                                       "deepspeed": SWIFT_Z3_2025}), []),
    "ms3": ("qwen2.5-14b", dict(SWIFT, method={"kind": "full"}, sequence_length=8192,
                                gradient_accumulation_steps=2, kernels=FLASH,
                                parallel={"strategy": "deepspeed", "devices": 8,
                                          "deepspeed": SWIFT_Z3}), []),
    "ms4": ("qwen2.5-14b", dict(SWIFT, method={"kind": "full"}, sequence_length=8192,
                                gradient_accumulation_steps=2, kernels=FLASH,
                                parallel={"strategy": "deepspeed", "devices": 8,
                                          "deepspeed": SWIFT_Z2}), []),
    "ms5": ("qwen2.5-14b", dict(SWIFT, method={"kind": "full"}, sequence_length=8192,
                                # Megatron's selective recompute is of the core attention,
                                # which its flash backend keeps no scores of: nothing saved less
                                activation_checkpointing="none", kernels=FLASH,
                                **MEGATRON,
                                parallel={"strategy": "deepspeed", "devices": 8, "tensor": 4,
                                          "sequence_parallel": True,
                                          "deepspeed": {"stage": 1}}), []),
    "ms6": ("qwen3-30b-a3b", dict(SWIFT, method={"kind": "full"}, sequence_length=8192,
                                  kernels=FLASH, moe=LOOP, parallel={"strategy": "deepspeed",
                                                           "devices": 8, "nodes": 2,
                                                           "deepspeed": SWIFT_Z3_2025}), []),
    "ms8": ("qwen3-30b-a3b", dict(SWIFT, method={"kind": "full"}, sequence_length=8192,
                                  kernels=FLASH, **MEGATRON,
                                  parallel={"strategy": "deepspeed", "devices": 4, "expert": 4,
                                            "deepspeed": {"stage": 1,
                                                          "offload_optimizer": "cpu"}}),
            []),
    "ms9": ("qwen3-30b-a3b", dict(SWIFT, **EXPANDABLE, method=SWIFT_LORA, micro_batch_size=8,
                                  kernels=FLASH, **MEGATRON,
                                  parallel={"strategy": "ddp", "devices": 2, "expert": 2}),
            [MAX_LEN]),
    # Megatron-SWIFT (ea766ff5b template/base.py: packing_mode under Megatron) packs a
    # micro-batch's 16 samples into one padding-free row padded to a multiple of 128: at most
    # 16 x 607 -> 9,728 tokens, the 16 x 608 planned
    "ms10": ("qwen2.5-7b", dict(SWIFT, **EXPANDABLE, method={"kind": "full"}, micro_batch_size=16,
                                sequence_length=ALPACA_MAX + 1, kernels=FLASH, **MEGATRON,
                                parallel={"strategy": "deepspeed", "devices": 2, "tensor": 2,
                                          "sequence_parallel": True,
                                          "deepspeed": {"stage": 1}}), [DATA_MAX]),
    "ms11": ("qwen2.5-7b", dict(SWIFT, **EXPANDABLE, method=SWIFT_LORA, micro_batch_size=16,
                                sequence_length=ALPACA_MAX + 1, kernels=FLASH, **MEGATRON,
                                parallel={"strategy": "ddp", "devices": 2, "tensor": 2,
                                          "sequence_parallel": True}), [DATA_MAX]),
    "ms12": ("qwen2.5-7b", dict(SWIFT, method=SWIFT_LORA, optimizer=FUSED_ADAMW,
                                sequence_length=SELF_COGNITION_MAX,
                                parallel={"strategy": "deepspeed", "devices": 2,
                                          "deepspeed": SWIFT_Z2}), []),
    "ms13": ("qwen2.5-7b", dict(SWIFT, method=SWIFT_LORA, optimizer=FUSED_ADAMW,
                                sequence_length=SELF_COGNITION_MAX,
                                parallel={"strategy": "deepspeed", "devices": 2,
                                          "deepspeed": SWIFT_Z3}), []),
    # gpt-oss's tokenizer and chat template are not Qwen2.5's: the table's 607 is approximate
    "ms14": ("gpt-oss-20b", dict(SWIFT, method=dict(GPT_OSS_ATTN, lora_alpha=32,
                                                    lora_dropout=0.05),
                                 sequence_length=ALPACA_MAX), [DATA_MAX]),
    # Apertus's MLP is not gated (xIELU, up/down only): the config's gate_proj matches nothing
    "ax1": ("apertus-8b", dict(AX, method=dict(AX_QLORA, lora_targets=[
        t for t in AX_QLORA["lora_targets"] if t != "gate_proj"]),
        optimizer={"name": "adamw_8bit"}, gradient_accumulation_steps=4), []),
    "ax2": ("olmo-3-7b", dict(AX, method=AX_QLORA, optimizer={"name": "adamw_8bit"},
                              gradient_accumulation_steps=2), []),
    "ax3": ("gpt-oss-20b", dict(AX, moe=LOOP, method=GPT_OSS_ATTN, sequence_length=4096,
                                micro_batch_size=1, gradient_accumulation_steps=8,
                                optimizer={"name": "adamw_8bit_torchao"},
                                activation_offloading=True,
                                kernels={"attention": "flash-attention-3",
                                         "cut_cross_entropy": True}), []),
    "ax4": ("gpt-oss-20b", dict(AX, moe=LOOP, method={"kind": "full"}, precision="bf16-true",
                                sequence_length=4096, micro_batch_size=1,
                                gradient_accumulation_steps=2, activation_offloading=True,
                                optimizer={"name": "adamw", "impl": "fused"},
                                kernels={"attention": "flash-attention-3",
                                         "cut_cross_entropy": True},
                                parallel={"strategy": "fsdp", "devices": 2,
                                          "cpu_offload": True}), []),
    "ax5": ("gpt-oss-20b", dict(AX, moe=LOOP, method={"kind": "full"}, precision="bf16-true",
                                sequence_length=4096, micro_batch_size=1,
                                gradient_accumulation_steps=2, activation_offloading=True,
                                optimizer={"name": "adamw_8bit_torchao"},
                                parallel={"strategy": "fsdp", "devices": 8}), []),
    "ax6": ("gpt-oss-20b", dict(AX, moe=LOOP, method={"kind": "full"}, precision="bf16-true",
                                sequence_length=4096, micro_batch_size=1,
                                gradient_accumulation_steps=2, activation_offloading=True,
                                optimizer={"name": "adamw_8bit_torchao"},
                                parallel={"strategy": "fsdp", "devices": 4}), []),
    "ax7": ("llama-4-scout-17b-16e",
            dict(AX, moe=LINEARIZED, method=dict(AX_QLORA, lora_alpha=64, lora_dropout=0.0),
                 sequence_length=4096, micro_batch_size=1, optimizer={"name": "adamw_4bit"},
                 activation_offloading=True, torch_compile=True,
                 kernels={"attention": "flex", "liger": ["rms_norm", "swiglu"],
                          "cut_cross_entropy": True}),
            ["the vision tower axolotl loads (Llama4ForConditionalGeneration) and its LoRA "
             "Triton kernels are not planned"]),
    "ax8": ("llama-4-scout-17b-16e",
            dict(AX, moe=LINEARIZED, method=dict(AX_QLORA, lora_alpha=64, lora_dropout=0.0,
                                           quant_storage="bf16"),
                 sequence_length=4096, micro_batch_size=2, optimizer={"name": "adamw_4bit"},
                 kernels={"attention": "flex", "liger": ["rms_norm", "swiglu"]},
                 parallel={"strategy": "fsdp", "devices": 4}),
            ["the vision tower axolotl loads (Llama4ForConditionalGeneration) is not planned"]),
    "ax9": ("mistral-small-24b", dict(AX, method=dict(AX_QLORA, lora_dropout=0.0,
                                                      lora_targets="all-linear"),
                                      gradient_accumulation_steps=4,
                                      optimizer={"name": "adamw"}), []),
    "pe1": ("llama-2-70b", dict(SWIFT, **PE_HF, method=PE_LORA, sequence_length=2048,
                                micro_batch_size=8, gradient_accumulation_steps=4,
                                optimizer={"name": "adamw"}, kernels=FLASH,
                                parallel={"strategy": "deepspeed", "devices": 8,
                                          "deepspeed": PE_Z3}), []),
    "pe2": ("llama-2-70b", dict(SWIFT, **PE_HF, method=dict(PE_LORA, kind="qlora", double_quant=True,
                                                   quant_storage="bf16"),
                                sequence_length=2048, micro_batch_size=2,
                                gradient_accumulation_steps=2, optimizer={"name": "adamw"},
                                kernels=FLASH, parallel={"strategy": "deepspeed", "devices": 2,
                                                         "deepspeed": PE_Z3}), []),
    "pe3": ("llama-2-70b", dict(**PE_HF, method=dict(PE_LORA, kind="qlora", double_quant=True,
                                            quant_storage="bf16", adapter_dtype="bf16"),
                                precision="bf16-true", activation_checkpointing="full",
                                sequence_length=2048, micro_batch_size=2, kernels=FLASH,
                                parallel={"strategy": "fsdp", "devices": 2, "fsdp_version": 1,
                                          "cpu_offload": True}), []),
    "pe4": ("llama-2-70b", dict(**PE_HF, method=dict(PE_LORA, kind="qlora", double_quant=True,
                                            quant_storage="bf16", adapter_dtype="bf16"),
                                precision="bf16-true", activation_checkpointing="full",
                                sequence_length=2048, micro_batch_size=2, kernels=FLASH,
                                parallel={"strategy": "fsdp", "devices": 2,
                                          "fsdp_version": 1}), []),
    "tt1": ("llama-3.1-8b", dict(TT, parallel={"strategy": "fsdp", "devices": 8}), []),
    "tt2": ("llama-3.1-8b", dict(TT, torch_compile=True,
                                 parallel={"strategy": "fsdp", "devices": 8}), []),
    "tt3": ("llama-3.1-8b", dict(TT, parallel={"strategy": "fsdp", "devices": 8,
                                               "nodes": 16}), []),
    # 8 x MI300X (ROCm), axolotl + DeepSpeed ZeRO-3: a practitioner's "about N GB VRAM"
    **{rid: ("qwen3-30b-a3b", dict(SHISA, micro_batch_size=mb), [SHISA_NOTE])
       for rid, mb in (("sh1", 8), ("sh2", 16), ("sh3", 32))},
}

# Rows no spec can write down (planned without the setting would mislead): left out, said.
NOT_PLANNED_2026 = {
    "ms7": "pipeline parallel (Megatron PP2 x EP8): a spec has no pipeline stages",
}

# The compared figure and unit where the row's text leaves them open (see the docstring).
KIND_2026: dict[str, tuple[str, int]] = {
    **dict.fromkeys(("ms1", "ms2", "ms3", "ms4", "ms14", "ax7", "ax8", "ax9"),
                    ("reserved_peak_bytes", 2**30)),
    **dict.fromkeys(("ms6", "ms12", "ms13", "ax1", "ax2", "ax3", "ax4", "ax5", "ax6", "tt1",
                     "tt2", "tt3"), ("reserved_peak_bytes", 2**30)),
    # Megatron-SWIFT logged no memory before 5a59dceab (2025-07-31: memory(GiB) =
    # max_memory_reserved in swift/megatron/init.py); Megatron's own report_memory prints MB once,
    # after the first iteration. A GiB figure written before then (ms5 2025-03-21, ms8
    # 2025-06-30, ms9-ms11 2025-07-10) is read as the device's, as nvidia-smi shows it.
    **dict.fromkeys(("ms5", "ms8", "ms9", "ms10", "ms11"), ("device_peak_bytes", 2**30)),
    **dict.fromkeys(("pe1", "pe2", "pe3", "pe4"), ("device_peak_bytes", 2**30)),
    **dict.fromkeys(("sh1", "sh2", "sh3"), ("device_peak_bytes", 2**30)),
}

# The software stack a row ran on, where it is not CUDA: the MI300X rows (the reserve replay,
# workspace and runtime context of resources/runtime.yaml's rocm stack)
STACK_2026 = dict.fromkeys(("sh1", "sh2", "sh3"), "rocm")

# Usable memory of the card a row ran on, where the published reserve met it: ms4 and ms6 ran
# at the A800 80GB's capacity (81,920 MiB).
CARD_BYTES_2026 = dict.fromkeys(("ms4", "ms6"), 81920 << 20)

# Why a row stays outside +-10% (the traced plan): filled from the run's output and sources.
WHY_2026: dict[str, str] = {
    "ms12": "not DeepSpeed's: the comment's session (ms-swift 7ef82cde5, 2024-11-25) wrote "
            "'17.2GiB' for the single-GPU LoRA of the same model and data, 2.2 GiB above its "
            "bf16 weights, logits and LoRA states, and ZeRO-2 adds 0.8 GiB to that - the plan's "
            "0.75 GiB of reduce buckets; the same session's DDP LoRA ('27.5GiB * 2') and packing "
            "('17.2GiB' at 8,192 tokens, where the fp32 logits alone are 4.6 GiB) figures cannot "
            "be right, so the 2.2 GiB is the session's, not a term any code path was found to hold",
    "ax2": "the figure's run cannot be the commit's own: at axolotl 372f664 (which added the "
           "'about 11.3 GiB' line) the pinned Cut Cross-Entropy fork (ml-cross-entropy 242b245) "
           "calls patch_olmo3 with an argument it does not take - a TypeError before the model "
           "loads, fixed in the fork's f4b5712 (2026-01-27) - so the version, and whether the "
           "loss ran fused, is open; without CCE the logits (4,096 x 100,278) add 2.3-3.8 GiB, "
           "the size of the gap. The same yaml template's sibling figures sit where the plan "
           "does: Apertus-8B 8.7 GiB (ax1, traced +6.5%), Ministral-8B 8.76 GiB",
    "ax6": "the same config as ax5 on 4 ranks instead of 8: the two published figures ('~36' "
           "and '~46 GiB/GPU') differ by 10 GiB, where the rank's sharded states alone differ "
           "by 14.7 GiB (20.9B parameters x 6.03 B - bf16 weights and gradients, torchao 8-bit "
           "moments - / 4 against / 8); no plan meets both within 10%, and ax5 is traced at "
           "+1.3%",
}
