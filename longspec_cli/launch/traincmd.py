"""The former name of launch.trainer's training line (launch/scaffold.py still imports it by this
name): launch.trainer owns every trainer module's command line."""

from longspec_cli.launch.trainer import TRAINER_MODULE, deepspeed_line, trainer_args  # noqa: F401
