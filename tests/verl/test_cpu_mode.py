"""verl on CPU is opt-in (`VERL_PLATFORM=cpu`), and loading the plugin resolves no device platform.

Each case is a fresh interpreter that imports verl the way a user's job does (the plugin arrives
through its `verl.plugins` entry point), then reports what verl ended up with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPORT = textwrap.dedent("""
    import json, sys
    import verl
    from verl.plugin.platform import platform_manager
    resolved_by_import = platform_manager._current_platform is not None
    import verl.workers.engine_workers as engine_workers
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl
    import verl.utils.model as model_utils
    from verl.workers.engine import EngineRegistry
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.plugin.platform import PlatformRegistry, get_platform
    platform = get_platform()
    print(json.dumps({
        "resolved_by_import_verl": resolved_by_import,
        "platform": type(platform).__name__,
        "device": platform.device_name,
        "cpu_registered": "cpu" in PlatformRegistry.registered_names(),
        "fsdp2_devices": sorted(EngineRegistry._engines["language_model"]["fsdp2"]),
        "odc_devices": sorted(EngineRegistry._engines["language_model"]["odc"]),
        "patched": [getattr(f, "_odc_patched", False) for f in (
            engine_workers.initialize_global_process_group_ray, transformer_impl.CPUOffloadPolicy,
            model_utils.load_valuehead_model)],
        "hf_adapter": ("hf", "async") in _ROLLOUT_REGISTRY,
        "hf_replica": "hf" in RolloutReplicaRegistry._registry,
    }))
""")
CPU_LINE = "odc_plugin: VERL_PLATFORM=cpu: verl runs on CPU"


def run(code: str, cwd, **env) -> tuple[dict, str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_without_the_switch_nothing_of_cpu_mode_is_there(tmp_path):
    report, stderr = run(REPORT, tmp_path)
    assert not report["resolved_by_import_verl"]
    assert not report["cpu_registered"] and report["device"] != "cpu"
    assert "cpu" not in report["fsdp2_devices"]
    assert report["odc_devices"] == ["cpu", "cuda"]  # the odc engines themselves serve both
    assert report["patched"] == [False, False, False]
    assert not report["hf_adapter"] and not report["hf_replica"]
    assert CPU_LINE not in stderr


def test_the_switch_turns_on_cpu_mode_and_says_so_once(tmp_path):
    report, stderr = run(REPORT, tmp_path, VERL_PLATFORM="cpu")
    assert not report["resolved_by_import_verl"]
    assert report["platform"] == "PlatformCPU" and report["device"] == "cpu"
    assert "cpu" in report["fsdp2_devices"]
    assert report["patched"] == [True, True, True]
    assert report["hf_adapter"] and report["hf_replica"]
    assert stderr.count(CPU_LINE) == 1


def test_a_platform_from_a_later_plugin_is_the_one_verl_uses(tmp_path):
    """Another `verl.plugins` entry point, discovered after this project's, registers a platform: verl
    must resolve to it. (It did not while loading our entry point resolved verl's platform.)"""
    plugin_dir = tmp_path / "later_plugin"
    dist_info = plugin_dir / "later_accel_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: later-accel-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[verl.plugins]\nlater_accel = later_accel\n")
    (plugin_dir / "later_accel.py").write_text(
        textwrap.dedent("""
        from verl.plugin.platform import PlatformRegistry
        from verl.plugin.platform.platform_cuda import PlatformCUDA

        @PlatformRegistry.register(platform="later_accel")
        class PlatformLaterAccel(PlatformCUDA):
            pass
    """)
    )
    # appended to sys.path: discovered after the installed packages, this project included
    code = f"import sys; sys.path.append({str(plugin_dir)!r})\n" + REPORT
    report, _ = run(code, tmp_path, VERL_PLATFORM="later_accel")
    assert not report["resolved_by_import_verl"]
    assert report["platform"] == "PlatformLaterAccel"
