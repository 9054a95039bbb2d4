"""The way between an ``nn.Module`` and dicts of tensors: ``fg.params``, ``fg.buffers``,
``fg.load_params`` and ``fg.call`` (``_model``), and the explained errors a forward
under ``torch.func`` or a training step raises (``_errors``: the texts funcgrad adds
to torch's own, and the one way they are raised). Imports only ``funcgrad.core``;
``funcgrad.step`` builds the training step on top. The public names are ``fg.*``.
"""
