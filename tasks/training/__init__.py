"""The training loop shared by pretrain and finetune (`trainer.fit`), AdamW (`adamw`; ZeRO-1's sharded one in `zero`;
the one for a mesh in `optimizer`) and the compiled step (`step`), checkpoints (`checkpoint`) and the memory
planner (`memory`). Networks come from tasks/modeling."""
