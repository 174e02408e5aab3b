"""HuggingFace Trainer with a fused optimizer (BERT-shaped model built from a config, random data).

    python examples/hf_trainer.py                                  # one process
    torchrun --nproc_per_node 2 examples/hf_trainer.py bytegrad    # DDP, gradients averaged by Bagua's bytegrad

``hf_plugin.BaguaTrainer`` is ``transformers.Trainer`` whose optimizer (the one Trainer would build,
AdamW by default) is fused and, with ``bagua_algorithm=``, whose DDP averages gradients with a Bagua
algorithm. No download: the model is built from a small ``BertConfig``.
"""

import sys
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

import hf_plugin

algorithm = sys.argv[1] if len(sys.argv) > 1 else None
config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=64, num_labels=2)
torch.manual_seed(0)
model = BertForSequenceClassification(config)
g = torch.Generator().manual_seed(1)
dataset = [{"input_ids": torch.randint(0, 256, (32,), generator=g), "labels": torch.tensor(i % 2)} for i in range(64)]

with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=1,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(),
                             logging_steps=4, disable_tqdm=True)
    trainer = hf_plugin.BaguaTrainer(model=model, args=args, train_dataset=dataset, bagua_algorithm=algorithm)
    result = trainer.train()
    report = hf_plugin.fusion_report(trainer.optimizer)
    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} steps, loss {result.training_loss:.3f}; optimizer paths "
              f"{report.group_paths}, {report.fused_params} tensors fused")
