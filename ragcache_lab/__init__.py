"""The benchmark lab: `ragcache bench ...` and `python -m ragcache_lab.<module>`. It lives beside the
packages in the checkout and is not in the wheel; it builds on the product (what users run on their
own model, such as calibration and the answer metrics, lives in engine_sidecar/calibrate/)."""
