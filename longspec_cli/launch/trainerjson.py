"""The former name of launch.trainer's running half (launch/scaffold.py still imports it by this
name): launch.trainer owns every trainer module's command line and starts it."""

from longspec_cli.launch.trainer import (ModuleRun, last_json, module_argv, run_module,  # noqa: F401
                                         run_trainer_json, trainer_available, trainer_root)
