"""Shared pytest setup: every test runs MindSpore on the CPU."""

import mindspore as ms

ms.set_device("CPU")  # must run once, before the first MindSpore op
