"""The instruments beside the training loop, as callbacks: throughput and MFU, model state, the step
profile (measure.py, flops.py), bytes sent (traffic.py), curves, result.json and the report (results.py).
Only the scripts import them; importing this package imports no torch (the runner reads flops, traffic)."""


def callbacks_for(args, bar=True):
    """What every script hands its loop, in the order it calls them: the counts and progress bar (`bar`:
    unless the caller has its own), the model state, the throughput, the curves, the bytes sent, any that
    SUITE_CALLBACKS names, the step profile with --profile, the report."""
    from . import curves, measure, results
    progress, profile = measure.Progress(bar), [measure.StepProfile(args.profile)] if args.profile else []
    throughput = measure.Throughput(progress)
    return [progress, measure.ModelStateCount(), throughput, curves.Curves(throughput),
            measure.CollectiveBytes(*profile), *measure.extra_callbacks(), *profile, results.Report(progress)]
