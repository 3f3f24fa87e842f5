"""Where stages run: a supervised child process (`supervise`, `child`) or msrun ranks
(`distributed`, `launch/worker.py`), with the data/tensor-parallel mesh (`mesh`)."""
