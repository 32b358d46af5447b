"""The request pipeline: one client request through named extension points, each feature a step.

See :mod:`gateway.request.pipeline` for the extension points and :mod:`gateway.request.director` for
the order they run in.
"""
