#!/usr/bin/env bash
# The seed's Table-2 runs (ZeRO-2 vs DDP, fp16, 10,000 train / 1,000 validation rows) on all GPUs
# of this machine, through the project's own CLI. Offline: the 400M architecture with random
# weights (`random-400M`) and a 10k-row dataset from the project's sample generator; timings do
# not depend on the weights because every row is padded to 128/64 (--pad_to_max_length) and a
# random model never emits EOS, so every generated reply has the full 64 tokens.
# Usage: bash scripts/gpu_seed_run.sh [RUN_DIR]   (results: RUN_DIR/{zero2,ddp}/all_results.json)
set -euo pipefail
RUN_DIR=${1:-runs/gpu_seed}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m finetune.sample_data --out_dir "$RUN_DIR/data" --n_train_dialogues 6300 --n_val_dialogues 750
python3 -c "from chat.model import resolve; resolve('random-400M')"
COMMON=(--model_name_or_path random-400M --train_file "$RUN_DIR/data/train.jsonl"
  --validation_file "$RUN_DIR/data/validation.jsonl" --max_source_length 128 --source_prefix "chatbot: "
  --max_target_length 64 --val_max_target_length 64 --val_min_target_length 20 --n_val_batch_generations 5
  --n_train 10000 --n_val 1000 --pad_to_max_length --num_beams 10 --learning_rate 1e-6 --weight_decay 0.0
  --num_train_epochs 1 --gradient_accumulation_steps 1 --num_warmup_steps 100 --seed 25 --logging_steps 5
  --with_tracking --report_to tensorboard --report_name blenderbot_400M_finetuning)
accelerate launch --config_file configs/accelerate/zero2_seed.yaml --num_processes "$NGPU" --mixed_precision fp16 \
  -m finetune "${COMMON[@]}" --per_device_train_batch_size 200 --per_device_eval_batch_size 100 --output_dir "$RUN_DIR/zero2"
accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes "$NGPU" --mixed_precision fp16 \
  -m finetune "${COMMON[@]}" --per_device_train_batch_size 100 --per_device_eval_batch_size 50 --output_dir "$RUN_DIR/ddp"
for s in zero2 ddp; do echo "== $s"; cat "$RUN_DIR/$s/all_results.json"; grep '"log"' "$RUN_DIR/$s/metrics.jsonl" | tail -2; done
