"""A model.init_from folder whose tensors do not match its config.json (a Qwen3 relabelled as
llama) under tsp-launch: one line from the launcher's own input check naming the tensor, exit 2,
before any rank starts."""

import json
import shutil
import time

from tests.helpers import hf_shapes
from tests.integration.test_tsp_launch import REPO, _tsp_launch


def test_mismatched_folder_is_one_line_and_exit_2_before_any_rank(tmp_path):
    folder = tmp_path / "qwen3"
    hf_shapes.save_tiny(folder, "qwen3")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1024,
               max_position_embeddings=4096)
    (folder / "config.json").write_text(json.dumps(raw))
    for f in (REPO / "data" / "tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    t0 = time.monotonic()
    proc = _tsp_launch(["model.size=null", f"model.init_from={folder}", "data.tokenizer=null",
                        f"train.output_dir={tmp_path / 'run'}"], timeout=120)
    seconds = time.monotonic() - t0
    print(f"\ntsp-launch, folder tensors unlike config.json: exit {proc.returncode} after {seconds:.1f} s")
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("tsp-launch: error: model.init_from="), lines
    # the first tensor unlike config.json: vocab rows of another size (256 saved, 1024 said)
    assert "tensor model.embed_tokens.weight: expected (1024, 64)" in lines[0] and "found (256, 64)" in lines[0]
    assert not (tmp_path / "run").exists()
