"""On the driver, at a run's end: the generation check (`eval.generate`). The final model completes
each prompt (greedy, so that two runs of the same model say the same); with chat data a prompt is
the user's turn, rendered with the run's own chat template and its assistant prompt. The outputs
go into the run's summary (printed at its end, in summary.json) and into MLflow as a table
(eval/generations.json, shown by the run's Evaluation and Artifacts tabs).

    eval:
      generate: {prompts: ["json.dumps(obj, *, skipkeys=False)"], max_new_tokens: 48}

The section: training/run/generate_config.py (read by the job config, without torch).
"""

from __future__ import annotations

from typing import Optional

from training import storage
from training.data.chat import TEMPLATE_FILE
from training.redaction import redact
from training.run import hf_export

TABLE_FILE = "eval/generations.json"  # (the MLflow artifact)
SUMMARY_KEY = "generations"  # (summary.json's, and the end summary's)
SHOWN_CHARS = 200  # of each prompt and output in the printed summary (the table holds them whole)


# --- at the run's end -------------------------------------------------------------------------

def chat_template(manifest) -> Optional[str]:
    """The template the chat data was rendered with (stored beside its tokenizer), None for other data."""
    uri = storage.join(manifest.root, TEMPLATE_FILE)
    return storage.read_text(uri) if storage.exists(uri) else None


def generations(job, manifest, model) -> list[dict]:
    """One row per prompt: the prompt, the text the model was given (rendered), and its output."""
    import torch  # (lazy: torch)

    config = job.eval.generate
    hf = hf_export.hf_model(job.model, model)
    tokenizer = hf_export.hf_tokenizer(job.model, job.data.options, manifest)
    if tokenizer is None:
        raise ValueError("the data has no tokenizer to turn the prompts into tokens")
    hf_export.with_special_tokens(hf, tokenizer)
    template = chat_template(manifest)
    limit = getattr(hf.config, "max_position_embeddings", None) or getattr(hf.config, "n_positions", None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for prompt in config.prompts:
        if template is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=template,
                                                 tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        # (the rendered template holds its own start token; a plain prompt gets the tokenizer's)
        ids = tokenizer(text, add_special_tokens=template is None, return_tensors="pt")["input_ids"]
        new_tokens = config.max_new_tokens
        if limit:  # prompt and output within the model's positions: the prompt's end kept, then fewer new tokens
            new_tokens = max(1, min(new_tokens, limit // 2, limit - ids.shape[1]))
            ids = ids[:, -(limit - new_tokens):]
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad)
        output = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        rows.append({"prompt": prompt, "input": text, "output": output, "new_tokens": int(out.shape[1] - ids.shape[1])})
    return rows


def generate_at_end(job, manifest, checkpoint, model, summary, log):
    """The eval.generate outputs into summary.extra["generations"]; returns the final model (loaded
    from `checkpoint` unless given). A failure only warns: the run and its model are done."""
    if job.eval.generate is None:
        return model
    try:
        if model is None:
            from training.run.final_model import load_final_model  # (lazy: torch)

            model = load_final_model(job.model, manifest, checkpoint)
        summary.extra[SUMMARY_KEY] = generations(job, manifest, model)
    except Exception as exc:
        log(redact(f"warning: eval.generate did not run ({type(exc).__name__}: {str(exc)[:300]})"))
    return model


def log_table(tracker, rows: Optional[list[dict]], log) -> bool:
    """The outputs as an MLflow table artifact (eval/generations.json); a failure only warns."""
    if not rows:
        return False
    try:
        tracker.client.log_table(tracker.run_id, {key: [row[key] for row in rows] for key in rows[0]}, TABLE_FILE)
    except Exception as exc:
        log(redact(f"warning: the eval.generate outputs were not logged to MLflow ({type(exc).__name__}: "
                   f"{str(exc)[:200]}); they are in the run's summary.json"))
        return False
    return True


def summary_lines(rows: Optional[list[dict]]) -> list[str]:
    """The outputs in the run's end summary, each prompt and output on one line."""
    def shown(text: str) -> str:
        text = text.replace("\n", "\\n")
        return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."

    lines = []
    for row in rows or ():
        lines += [f"  prompt: {shown(row['prompt'])}", f"    -> {shown(row['output'])}"]
    return (["  generated (eval.generate):"] + lines) if lines else []
