"""Which zero_optimization keys DeepSpeed's engine reads at each ZeRO stage, recorded by running it.

``python tests/zero_reads.py`` builds a tiny model, runs deepspeed.initialize and one step per
stage (0-3) on the CPU, and a save_16bit_model, (world size 1, gloo), and prints a JSON object {stage: [keys]}: the JSON
names of the DeepSpeedZeroConfig fields read outside the config class's own validators. The
corpus test uses it, not hfscale's stage table, to judge a key the import leaves out as one
DeepSpeed does not use at that stage; a test checks hfscale's table against it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.zero import config as zero_config

    cls = zero_config.DeepSpeedZeroConfig
    alias = {name: (f.alias or name) for name, f in cls.model_fields.items()}
    validators = os.path.abspath(zero_config.__file__)
    reads: set[str] = set()
    original = cls.__getattribute__

    def recording(self, name):
        if name in alias and os.path.abspath(sys._getframe(1).f_code.co_filename) != validators:
            reads.add(alias[name])
        return original(self, name)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("ZR_PORT", "29641"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed("gloo")
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
        reads.clear()
        cls.__getattribute__ = recording
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                              config=config)
            loss = engine(torch.randn(2, 8)).sum()
            engine.backward(loss)
            engine.step()
            with tempfile.TemporaryDirectory() as saved:
                engine.save_16bit_model(saved)
        finally:
            cls.__getattribute__ = original
        out[stage] = sorted(reads)
        del engine
    print("ZERO_READS " + json.dumps(out))


if __name__ == "__main__":
    main()
