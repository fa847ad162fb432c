#!/usr/bin/env bash
# Rebuilds chat/demo_model/, the checkpoint the chat serves when the Hub is unreachable: the
# tiny preset trained by the project's own command on the shipped sample data (2 CPU
# processes, DeepSpeed ZeRO-2, about 5 minutes on a 2-core CPU). Run from the repository root.
# Its validation BLEU is measured as the Train tab's runs measure theirs (beams 4, the CLI's minimum
# length 20 and n-gram blocking), so the chat's model picker compares like with like
# (finetune/measure.py). The committed model was trained with --val_min_target_length 1 and no
# blocking (BLEU 60.0) and measured again with `python -m finetune.rescore chat/demo_model`.
set -euo pipefail
RUN_DIR=${1:-runs/demo}
rm -rf "$RUN_DIR"
accelerate launch --config_file configs/accelerate/cpu_zero2.yaml -m finetune \
  --model_name_or_path tiny --dataset_name sample --output_dir "$RUN_DIR" \
  --num_train_epochs 30 --learning_rate 1e-3 --num_warmup_steps 100 \
  --per_device_train_batch_size 16 --per_device_eval_batch_size 32 --num_beams 4
rm -rf chat/demo_model
cp -r "$RUN_DIR/final" chat/demo_model
du -sh chat/demo_model
