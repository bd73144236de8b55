"""Whether a node's draft model (`--draft-model`) may draft for a model it
serves: only for a model split across no other node (its ranks would each need
the draft model and draft alike), and only with the same tokens, which the
node checks before it starts the runner (the runner checks again when it loads
both: `engine/mlx/draft_model.py`)."""

from pathlib import Path

from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer


def draft_refusal(
    draft: str, draft_dir: Path | None, served: ChatTokenizer, ranks: int
) -> str | None:
    """Why the draft model `draft` (its folder: `draft_dir`, None where this node
    has none) does not draft for a served model of tokenizer `served` placed on
    `ranks` ranks; None where it does."""
    if ranks > 1:
        return f"{draft} drafts only for a model placed whole on one node"
    if draft_dir is None:
        return f"{draft} is not in this node's models directory"
    theirs = load_chat_tokenizer(draft_dir)
    mine_vocab, their_vocab = served.get_vocab(), theirs.get_vocab()
    if mine_vocab != their_vocab:
        return (
            f"{draft}'s tokenizer differs from the model's ({len(their_vocab)} and "
            f"{len(mine_vocab)} tokens): a draft model must be a smaller model of its family"
        )
    return None
