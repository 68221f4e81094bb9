"""The Spark pipeline over load histories: ``lbd analytics synth|report|replay``.

Needs the ``analytics`` extra (pyspark, pyarrow, matplotlib). :mod:`lbd.analytics.engine` and
:mod:`lbd.analytics.scenarios` are plain Python over the core; the rest drives Spark.
"""
