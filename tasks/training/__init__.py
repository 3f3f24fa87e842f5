"""The training loop shared by pretrain and finetune (`trainer.fit`), AdamW (`adamw`; ZeRO-1's sharded one in `zero`)
and the compiled step (`step`), checkpoints (`checkpoint`), the memory planner (`memory`) and TensorBoard events."""
