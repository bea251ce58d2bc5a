"""Prompt embeddings (`--enable-prompt-embeds`): a prompt given as rows of the model's input embeddings.

    tensors.py   the front end: a tensor (offline) or torch.save's bytes in base64 (the API's) checked
                 and packed for the wire (wire/messages.py's PromptEmbeds)
    inputs.py    the model runner's side: the rows put in place of the embedding lookup
    layer.py     the engine layer that attaches it
"""
