"""Messages that lead somewhere: each names the field, the value, and what to do instead."""

import numpy as np
import pytest

import dsched


def test_a_dataframe_is_named_with_what_to_pass_instead():
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": np.arange(5.0)})
    s = dsched.SimpleScheduler("cpu", 2)
    with pytest.raises(ValueError, match=r"^args\[0\]: a pandas DataFrame is not split by dsched; pass its columns"):
        dsched.dispatch(lambda d: d, frame, scheduler=s, mode="sync")
    with pytest.raises(ValueError, match=r"^args\[0\]\['x'\]: a pandas Series is not split by dsched; pass "
                                         r"series\.to_numpy\(\)"):
        dsched.dispatch(lambda d: d, {"x": frame["a"]}, scheduler=s, mode="sync")


def test_a_graph_with_more_items_than_any_device_holds_is_a_one_line_exit_2(tmp_path, capsys):
    from dsched.apps.cli import main

    graph = tmp_path / "big.toml"
    graph.write_text('[model]\nname = "j2"\n\n[batch]\nsize = 1000\n\n[scheduler]\ntype = "SimpleScheduler"\n'
                     'device = "cpu"\nbatch_size = 4_611_686_018_427_387_904\n')
    assert main(["run", str(graph)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dsched: error: scheduler.batch_size: 4,611,686,018,427,387,904 is more items than any device "
                   f"can hold (at most 1,000,000,000,000,000) in {graph}")
