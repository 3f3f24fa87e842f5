"""The training loop shared by pretrain and finetune (`trainer.fit`), AdamW and the compiled step
(`optim`), checkpoints (`checkpoint`), the memory planner (`memory`) and TensorBoard events."""
