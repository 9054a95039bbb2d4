"""State in and out: states as plain nested dicts (``_state_dict``: ``fg.state_dict``,
``fg.load_state_dict``), checkpoints (``_checkpoint``: ``fg.save_checkpoint``,
``fg.load_checkpoint``; directories through ``funcgrad.distributed``) and
``torch.optim`` state both ways (``_torch_state``). Imports every layer below it; not
``funcgrad.torch_optim`` (an ``fg.Optimizer`` is known by what it does). The public
names are ``fg.*``.
"""
