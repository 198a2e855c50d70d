"""The agents' options: tools switch on rollout_mode multi_turn, and what cannot go with them is refused by name
before any work (config and command line)."""

import pytest

from grpo_fast.cli import build_parser, config_from_args
from grpo_fast.config import GRPOConfig


def test_tools_switch_on_multi_turn():
    assert GRPOConfig(tools=["calculator"]).rollout_mode == "multi_turn"
    assert GRPOConfig().rollout_mode == "parallel"


@pytest.mark.parametrize("fields, words", [
    (dict(tools=["calculator"], rollout_mode="early_exit", num_generations=8),
     "rollout_mode='early_exit' is invalid: expected 'multi_turn'"),
    (dict(rollout_mode="multi_turn"), "tools=None is invalid: expected at least one tool"),
    (dict(tools=["calculator"], max_staleness=1, engine="hf"), "engine='hf' is invalid: expected 'vllm' or 'auto' with max_staleness=1"),
    (dict(tools=["calculator"], tool_timeout=0), "tool_timeout"),
    (dict(tools=["calculator"], max_tool_response_tokens=0), "max_tool_response_tokens"),
    (dict(tools=[None]), r"tools=\[None\] is invalid: expected tool names, none empty"),
    (dict(tools=["calculator", " "]), r"tools=\['calculator', ' '\] is invalid: expected tool names, none empty"),
    (dict(tools=["calculator"], max_tool_calls_per_turn=0), "max_tool_calls_per_turn"),
    (dict(tools=["calculator"], tool_isolation="container"), r"tool_isolation='container' is invalid: expected one of"),
    (dict(environment_factory="tests.agents.test_environments:Counter", tool_isolation="process"),
     "tool_isolation='process' is invalid: expected 'thread' with environment_factory"),
])
def test_what_cannot_go_with_tools_is_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        GRPOConfig(**fields)


def test_command_line_takes_tools_and_template_kwargs():
    parser = build_parser()
    args = parser.parse_args(["train", "--tools", "calculator,tests.agents.tool_model:add",
                              "--chat_template_kwargs", '{"enable_thinking": false}', "--max_tool_calling_iterations", "3"])
    config = config_from_args(args)
    assert config.tools == ["calculator", "tests.agents.tool_model:add"] and config.rollout_mode == "multi_turn"
    assert config.chat_template_kwargs == {"enable_thinking": False} and config.max_tool_calling_iterations == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--chat_template_kwargs", "[1, 2]"])


def test_environment_factory_by_name_from_the_command_line():
    from grpo_fast.generation.agents.parts import agent_parts

    args = build_parser().parse_args(["train", "--environment_factory", "tests.agents.test_environments:Counter"])
    config = config_from_args(args)
    assert config.rollout_mode == "multi_turn"
    tools, environments = agent_parts(tool_names=config.tools, environment_name=config.environment_factory)
    assert tools == [] and [f.__name__ for f in environments.reward_functions()] == ["Counter"]
    assert sorted(s["function"]["name"] for s in environments.schemas(None)) == ["add", "mul"]
    bad = config_from_args(build_parser().parse_args(["train", "--environment_factory", "tests.agents.nope:Env"]))
    with pytest.raises(ValueError, match="environment_factory: cannot load 'tests.agents.nope:Env'"):
        agent_parts(tool_names=bad.tools, environment_name=bad.environment_factory)


def test_empty_tools_on_the_command_line_is_one_line(capsys):
    """`--tools ""` (an empty entry) is refused in one line naming the option, before any work (it was a TypeError
    deep in the tools' resolution)."""
    from grpo_fast.cli import main

    assert main(["train", "--tools", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo-fast train: GRPOConfig.tools=[None] is invalid: expected tool "
                                                   "names, none empty"), err
