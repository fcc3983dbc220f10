"""Training: the Trainer (``trainer``), optimisers and schedules (``optim``), step-N checkpoints and the run lock
(``checkpoint``), fine-tuning (``finetune``). Imports inference (validation) and below; not serve or interop."""
