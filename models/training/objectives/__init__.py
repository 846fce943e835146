"""Training objectives as plug-ins (`debias.objective`; issue 65): each one a module of this package and a YAML of
conf/debias/, registered by name (`base.register`); train.py reaches them through `build`, `validate` and the
`TrainingObjective` interface only. A new objective is one module here (every module of the package is imported, so
that it registers) and one YAML."""
import importlib
import pkgutil

from models.training.objectives.base import (  # noqa: F401 (the package's interface)
    Context,
    Preparation,
    StartUp,
    TrainingObjective,
    build,
    names,
    objective_class,
    register,
    validate,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
