"""The official Margo conformance kit's WFM tests, runnable against any WFM.

`conformance.runner` runs the kit's declarative scenario files (the step schema of the kit
README section 2.3) and `conformance.postman` converts its Postman collections into such
steps (section 2.4); `conformance.registry` stands in for the `oras` CLI in the registry
steps. `margo conformance wfm` is the command around them.
"""

from conformance.runner import (
    CertDir,
    Runner,
    RunnerOptions,
    StepResult,
    Suite,
    SuiteError,
    SuiteReport,
    load_suite,
)

__all__ = [
    "CertDir",
    "Runner",
    "RunnerOptions",
    "StepResult",
    "Suite",
    "SuiteError",
    "SuiteReport",
    "load_suite",
]
