"""``jalapeno-emu validate``: GPU presets against measured InferenceX serving points.

Stage: validation, on top of the rack model. Modules, one job each:

- :mod:`~jalapeno_emu.validation.points`: the packaged CSV (``data/``, with its README) as records;
- :mod:`~jalapeno_emu.validation.rows`: each point's preset, model config, formats, mapping, class;
- :mod:`~jalapeno_emu.validation.retime`: knob settings and the timers that re-time kept Programs;
- :mod:`~jalapeno_emu.validation.calibrate`: MAPE, grid-search calibration and leave-one-out (pure math);
- :mod:`~jalapeno_emu.validation.run`: predicts every row at every knob setting and assembles the report.

Only timing knobs of the GPU presets are calibrated; the Jalapeño presets are never touched.
"""
