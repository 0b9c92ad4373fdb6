"""The training job's configuration, in one package: flag name = attribute path.

- :mod:`~openrlhf_shape.config.tree`: the sections (``cfg.train.batch_size`` is ``--train.batch_size``);
- :mod:`~openrlhf_shape.config.checks`: validation across sections;
- :mod:`~openrlhf_shape.config.load`: defaults <- YAML preset <- flags, and an old run's saved config;
- :mod:`~openrlhf_shape.config.compat`: this project's old names (deprecated) and OpenRLHF's value encodings;
- :mod:`~openrlhf_shape.config.openrlhf`: OpenRLHF 0.11's flags and what happens to each (refusal table);
- :mod:`~openrlhf_shape.config.flags`: the generic dotted-flag machinery (also used by ``eval``).
"""

from openrlhf_shape.config.load import DERIVED, FLAGS, config_from_dict, flag_view, load_config
from openrlhf_shape.config.tree import TrainConfig

__all__ = ["DERIVED", "FLAGS", "TrainConfig", "config_from_dict", "flag_view", "load_config"]
