"""Run inside the speculators venv (``scripts/setup.sh`` builds ``.venv-speculators``), by ``tests/test_interop.py``:
the vLLM project's own ``speculators`` code loads checkpoints and drafts, and nothing of tokenmaxx is imported here.

    .venv-speculators/bin/python tests/speculators_side.py JOBS.json

JOBS.json: a list of jobs ``{"checkpoint": DIR, "inputs": FILE, "out": FILE, "steps": S, "verifier_embedding":
bool}``. Each job loads DIR with ``Eagle3DraftModel.from_pretrained`` (eager attention: speculators' default flex
attention needs sequences in multiples of 128), optionally takes the embedding from the verifier
(``verifier_embedding``: what a checkpoint converted from the eagle3 layout needs, which has none), reads the
backbone's hidden states [L+1, T, H] and token ids [T] from FILE (safetensors), fuses the layers ITS config names (as
an engine would), and runs its training-time forward for S draft steps over the T-1 positions (speculators' inputs
are shifted: the state at t with the token at t+1). Writes to ``out``: ``logits`` [S, T-1, Vd] (captured at its
lm_head) and ``tokens`` [S, T-1] (their argmax as target ids, through its ``d2t``); prints one JSON line per job
with the layer ids it fused and its version.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file


def run(job: dict) -> dict:
    import speculators
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(job["checkpoint"])
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(job["checkpoint"], config=config).float().eval()
    if job.get("verifier_embedding"):
        model._load_verifier_weights(overwrite_embed_tokens=True)
    inputs = load_file(job["inputs"])
    states, ids = inputs["hidden_states"].float(), inputs["input_ids"].long()  # [L+1, T, H], [T]
    layers = list(model.config.eagle_aux_hidden_state_layer_ids)
    fused = torch.cat([states[i] for i in layers], dim=-1)[None]  # [1, T, len(layers) * H]
    seq = ids.shape[0]
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach().float()))
    with torch.no_grad():
        model(hidden_states=fused[:, :-1], input_ids=ids[None, 1:], document_ids=torch.zeros(1, seq - 1,
                                                                                           dtype=torch.long),
              ttt_steps=job["steps"])
    hook.remove()
    logits = torch.cat(captured)  # [S, T-1, Vd]
    best = logits.argmax(-1)
    d2t = model.d2t if getattr(model, "d2t", None) is not None else torch.zeros(logits.shape[-1], dtype=torch.long)
    tokens = best + d2t.to(best.device)[best]  # [S, T-1] target ids
    save_file({"logits": logits.contiguous(), "tokens": tokens.contiguous()}, job["out"])
    return {"checkpoint": job["checkpoint"], "layers": layers, "speculators": speculators.__version__
            if hasattr(speculators, "__version__") else _version()}


def _version() -> str:
    from importlib.metadata import version

    return version("speculators")


if __name__ == "__main__":
    for job in json.loads(open(sys.argv[1]).read()):
        print(json.dumps(run(job)), flush=True)
