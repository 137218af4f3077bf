"""Webhook notifications without Ray: targets and their environment variables, the messages, the
retry policy, and real posts to a real http.server on loopback (one that answers, one that fails
first, one that is down)."""

import pytest
from conftest import CONFIGS
from webhook import receiver

from training import config as config_lib
from training.errors import ConfigError
from training.observe import notify
from training.observe.notify import Target, event_for_transition, resolve, run_message, shown_url, sweep_message
from training.observe.webhook import Notifier, PostPolicy

SECRET = "T0KEN-s3cret-path"


def job(*targets):
    return config_lib.load(CONFIGS / "digits.yaml", [f"tracking.notify={list(targets)}"])


def test_a_url_from_an_environment_variable_is_resolved_only_when_asked():
    loaded = job({"url": "${HOOK}", "on": ["finished", "restarted"]})
    assert loaded.tracking.notify[0].on == ["finished", "restarted"]
    (target,) = resolve(loaded.tracking.notify, {"HOOK": f"https://hooks.example.com/{SECRET}"})
    assert target.url == f"https://hooks.example.com/{SECRET}" and target.events == ("finished", "restarted")
    assert SECRET not in repr(target) and target.field == "tracking.notify.0"
    # the written form is what is shown and stored
    assert "${HOOK}" in config_lib.to_yaml(loaded) and SECRET not in str(config_lib.flatten(loaded))


def test_yaml_on_is_read_as_the_key_it_was_written_as(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {max_steps: 10}\ntracking:\n  notify:\n    - {url: 'https://h.example/x', on: [failed]}\n")
    assert config_lib.load(path).tracking.notify[0].on == ["failed"]


def test_a_literal_url_is_masked_wherever_the_config_is_shown():
    loaded = job({"url": f"https://hooks.example.com/services/{SECRET}"})
    assert loaded.tracking.notify[0].on == ["finished", "failed"]  # the default events
    shown = config_lib.to_yaml(loaded) + str(config_lib.flatten(loaded))
    assert SECRET not in shown and "https://hooks.example.com/***" in shown
    assert config_lib.without_notify(loaded.model_dump(mode="json"))["tracking"]["notify"] == []
    assert shown_url("http://127.0.0.1:8080/a?b=c") == "http://127.0.0.1:8080/***"


@pytest.mark.parametrize("raw, message", [
    ({"url": "https://h.example/x", "on": ["finish"]},
     "tracking.notify.0.on.0: must be 'finished', 'failed', 'preempted' or 'restarted'"),
    ({"url": "ftp://h.example/x"}, "tracking.notify.0.url: the URL ftp://h.example/*** must start with https://"),
    ({"url": "https://"}, "tracking.notify.0.url: the URL *** names no host"),
    ({"url": f"https://h.example/{SECRET} x"}, "tracking.notify.0.url: the URL https://h.example/*** contains a space"),
    ({"url": "${SLACK-HOOK}"}, "tracking.notify.0.url: has a malformed variable reference"),
    ({"url": f"https://h.example/{SECRET}${{HOOK"}, "tracking.notify.0.url: has a malformed variable reference"),
    ({"url": "https://h.example/x", "on": []}, "tracking.notify.0.on: List should have at least 1 item"),
    ({"on": ["failed"]}, "tracking.notify.0.url: Field required"),
])
def test_bad_targets_are_refused_naming_the_field(raw, message):
    with pytest.raises(ConfigError) as refused:
        job(raw)
    assert message in str(refused.value) and SECRET not in str(refused.value)


def test_a_variable_that_is_not_set_or_not_a_url_is_refused_by_name_never_by_value():
    loaded = job({"url": "https://h.example/x"}, {"url": "${HOOK}"})
    with pytest.raises(ConfigError, match=r"tracking.notify.1.url: the environment variable HOOK is not set"):
        resolve(loaded.tracking.notify, {})
    with pytest.raises(ConfigError) as refused:
        resolve(loaded.tracking.notify, {"HOOK": f"hooks.example.com/{SECRET}"})
    assert "tracking.notify.1.url: the URL (from $HOOK) must start with https://" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_controller_states_that_are_events():
    assert event_for_transition("RUNNING", "RESTARTING") == "restarted"
    assert event_for_transition("SCHEDULING", "RESCHEDULING") == "restarted"
    assert event_for_transition("RUNNING", "PREEMPTING") == "preempted"
    assert event_for_transition("PREEMPTING", "PREEMPTING") is None
    assert event_for_transition("PREEMPTING", "RESTARTING") == "restarted"
    for quiet in ("SCHEDULING", "RUNNING", "RESIZING", "FINISHED", "ERRORED", "SHUTTING_DOWN"):
        assert event_for_transition("RUNNING", quiet) is None


def test_messages_carry_what_a_person_needs_and_a_slack_text():
    body = run_message("finished", "r1", step=400, total_steps=400, metrics={"val_accuracy": 0.98, "lr": 0.1},
                       mlflow_run_id="abc", mlflow_url="http://mlflow:5000/#/experiments/1/runs/abc", restarts=1)
    assert body["metrics"] == {"val_accuracy": 0.98} and body["status"] == "finished" and body["step"] == 400
    assert body["text"].startswith("run r1 finished at step 400/400") and "MLflow: http://mlflow:5000/" in body["text"]
    failed = run_message("failed", "r1", error="training run r1 failed: boom")
    assert "error: training run r1 failed: boom" in failed["text"]
    sweep = sweep_message("finished", "s", counts={"finished": 2, "stopped": 1, "failed": 0}, metric="val_accuracy",
                          best={"trial_id": "t1", "run": "s-t1", "value": 0.97, "steps": 40, "params": {}})
    assert sweep["text"].startswith("sweep s finished: 2 finished, 1 stopped, 0 failed") \
        and "best trial t1" in sweep["text"]
    assert notify.mlflow_run_url("http://u:pw@mlflow.example:5000/", "3", "abc") == \
        "http://mlflow.example:5000/#/experiments/3/runs/abc"
    assert notify.mlflow_run_url("sqlite:///mlflow.db", "3", "abc") is None


def test_post_policy_retries_briefly_and_gives_up_on_the_requests_own_faults():
    policy = PostPolicy(attempts=3, backoff_s=1.0)
    assert [policy.retry_after_s(n, None) for n in (1, 2, 3)] == [1.0, 2.0, None]
    assert policy.retry_after_s(1, 500) == 1.0 and policy.retry_after_s(1, 429) == 1.0
    assert policy.retry_after_s(1, 404) is None and policy.retry_after_s(1, 403) is None


def test_posts_reach_a_real_receiver_once_and_a_failing_one_is_retried_then_logged():
    warnings = []
    with receiver() as good, receiver(fail_first=1) as flaky, receiver(fail_first=9, status=404) as gone:
        targets = [Target("tracking.notify.0", good.url(f"/{SECRET}"), ("finished",)),
                   Target("tracking.notify.1", flaky.url(f"/{SECRET}"), ("finished", "failed")),
                   Target("tracking.notify.2", gone.url(f"/{SECRET}"), ("finished",))]
        notifier = Notifier(targets, PostPolicy(backoff_s=0.01), warn=warnings.append)
        deliveries = notifier.notify("finished", run_message("finished", "r1", step=3))
        assert [d.delivered for d in deliveries] == [True, True, False]
        assert [d.attempts for d in deliveries] == [1, 2, 1]  # a 404 is not retried
        assert good.events() == ["finished"] and good.posts[0]["path"] == f"/{SECRET}"
        assert flaky.events() == ["finished"] and flaky.refused == 1
        assert good.posts[0]["body"]["text"].startswith("run r1 finished")
        assert notifier.notify("restarted", {"event": "restarted"}) == []  # nobody subscribed
    assert len(warnings) == 1 and "tracking.notify.2 (127.0.0.1)" in warnings[0] and "HTTP 404" in warnings[0]
    assert SECRET not in " ".join(warnings)


def test_a_nan_or_infinite_metric_is_posted_as_json_null_that_a_strict_receiver_takes():
    """Python's json writes NaN as a bare `NaN`: a strict receiver answers 400, which is not
    retried, and the notification was lost. The body is strict JSON with the number as null."""
    import numpy as np

    warnings = []
    with receiver() as strict:
        notifier = Notifier([Target("tracking.notify.0", strict.url(), ("failed", "finished"))],
                            PostPolicy(backoff_s=0.01), warn=warnings.append)
        failed = run_message("failed", "r1", step=7, metrics={"train_loss": float("nan"), "val_loss": float("inf")},
                             error="loss is nan")
        sweep = sweep_message("finished", "s", counts={"finished": 1}, metric="val_loss",
                              best={"trial_id": "t1", "run": "s-t1", "value": np.float32("-inf"), "steps": 4,
                                    "params": {"lr": [np.float64("nan"), 0.5]}})
        assert [d.delivered for d in notifier.notify("failed", failed) + notifier.notify("finished", sweep)] \
            == [True, True]
        assert strict.malformed == [] and warnings == []
        run_body, sweep_body = (post["body"] for post in strict.posts)
    assert run_body["metrics"] == {"train_loss": None, "val_loss": None} and "train_loss nan" in run_body["text"]
    assert sweep_body["best"]["value"] is None and sweep_body["best"]["params"] == {"lr": [None, 0.5]}
    assert sweep_body["best"]["steps"] == 4 and run_body["step"] == 7  # integers stay integers


def test_a_receiver_that_is_down_costs_a_warning_and_no_exception():
    with receiver() as down:
        url = down.url(f"/{SECRET}")
    warnings = []
    notifier = Notifier([Target("tracking.notify.0", url, ("failed",))], PostPolicy(backoff_s=0.01),
                        warn=warnings.append)
    (delivery,) = notifier.notify("failed", run_message("failed", "r1"))
    assert not delivery.delivered and delivery.attempts == 3
    assert "ConnectionRefusedError" in warnings[0] or "Connection refused" in warnings[0]
    assert url not in warnings[0] and SECRET not in warnings[0]


def test_a_preemption_notice_on_the_controller_posts_preempted(tmp_path):
    from training.observe.callback import RunEvents

    with receiver() as hook:
        events = RunEvents("r1", str(tmp_path / "r1"),
                           Notifier([Target("tracking.notify.0", hook.url(), ("preempted",))]))
        events.on_report({"step": 12, "total_steps": 50, "val_loss": 0.3}, checkpointed=False)
        events.on_state("RUNNING", "PREEMPTING")
        events.on_state("PREEMPTING", "PREEMPTING")  # the controller polls the drain: one notice, one post
        events.on_state("PREEMPTING", "RESTARTING")  # not subscribed
        events.on_end()
        assert hook.events() == ["preempted"]
        body = hook.posts[0]["body"]
        assert body["step"] == 12 and body["text"].startswith("run r1 preempted at step 12/50: a node holding a worker")
    assert events.preemptions == 1 and events.restarts == 1


def test_a_sweep_that_fails_posts_failed_with_its_error_line(tmp_path):
    from training.tracking.tracker import NullTracker
    from tuning import config as sweep_config
    from tuning.sweep import SweepSummary, _notify

    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {CONFIGS / 'digits.yaml'}\nspace:\n  optim.lr: {{grid: [0.01]}}\n")
    sweep = sweep_config.load(path, ["tracking.notify=[{url: '${SWEEP_HOOK}', on: [failed]}]"], name="s1")
    with receiver() as hook:
        (target,) = resolve(sweep.base.tracking.notify, {"SWEEP_HOOK": hook.url(f"/{SECRET}")})
        lines = []
        _notify(sweep, SweepSummary("s1", str(tmp_path)), NullTracker(), [target], "failed", lines.append,
                error="RuntimeError: the cluster went away\n  more lines")
        _notify(sweep, SweepSummary("s1", str(tmp_path)), NullTracker(), [target], "finished", lines.append)
        assert hook.events() == ["failed"]  # finished: not subscribed
        body = hook.posts[0]["body"]
        assert body["kind"] == "sweep" and body["error"] == "RuntimeError: the cluster went away"
        assert body["counts"] == {"finished": 0, "stopped": 0, "failed": 0} and body["best"] is None
    assert lines == []
