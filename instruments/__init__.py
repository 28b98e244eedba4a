"""The instruments beside the training loop: throughput and MFU (measure.py, flops.py), the model
state, the bytes sent per step (traffic.py), the curves (curves.py), the step profile, and result.json
with the printed report (results.py). The loop knows only the callback protocol (support/callbacks.py):
a script hands it callbacks_for(args), and nothing below the scripts imports this package. Importing it
imports no torch (the runner reads flops.py and traffic.py); callbacks_for does."""


def callbacks_for(args, bar=True):
    """The instruments every script hands its loop, in the order the loop calls them: the counts and
    progress bar (without it where the caller has its own: `bar`), the model state, the throughput, the
    curves, the bytes sent, any that SUITE_CALLBACKS names, the step profile with --profile, the report."""
    from . import curves, measure, results
    progress = measure.Progress(bar)
    throughput = measure.Throughput(progress)
    profile = [measure.StepProfile(args.profile)] if args.profile else []
    return [progress, measure.ModelStateCount(), throughput, curves.Curves(progress, throughput),
            measure.CollectiveBytes(*profile), *measure.extra_callbacks(), *profile, results.Report(progress)]
