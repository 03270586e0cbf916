"""Push a complete model repository (weights, code, tokenizer, card) to the Hub in one commit.

`model.push_to_hub` alone uploads the weights, config (with `auto_map`), code files and generation config, but it puts
a generic card into a repository that has none, and the tokenizer needs a second commit. `push_repository` saves all
of it into one folder and sends a single commit, so the repository never exists half-uploaded.
"""

import tempfile
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, ModelCard
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils.hub import hf_api

from .model_card_vanilla_transformer import build_model_card


def push_repository(
    model: PreTrainedModel,
    repo_id: str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    card: ModelCard | None = None,
    commit_message: str = "Upload model, tokenizer and model card",
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Create `repo_id` if needed and upload the model, its tokenizer and its card as one commit.

    Args:
        model: the model to upload; `save_pretrained` writes the safetensors weights, `config.json` with `auto_map`
            for every Auto class that loads it, `generation_config.json` and the `.py` files of the code.
        repo_id: `"user/name"` or `"org/name"`.
        tokenizer: saved next to the model so that `AutoTokenizer.from_pretrained(repo_id)` works.
        card: the README; by default `build_model_card(model, repo_id=repo_id)`.
        commit_message, private, token, revision, create_pr: as in `PreTrainedModel.push_to_hub`.

    Returns:
        The `CommitInfo` of the commit.
    """
    api = hf_api()  # the HfApi instance transformers' own push_to_hub uses (it reports library_name=transformers)
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not create_pr:
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)  # a commit needs its branch to exist
    card = card if card is not None else build_model_card(model, repo_id=repo_id)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        card.save(Path(folder) / "README.md")
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
            for path in sorted(Path(folder).rglob("*"))
            if path.is_file()
        ]
        return api.create_commit(
            repo_id=repo_id,
            operations=operations,
            commit_message=commit_message,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )


__all__ = ["push_repository"]
