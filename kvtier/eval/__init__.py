"""The accuracy-vs-footprint harness behind `kvtier eval`: an application of kvtier, free to
import transformers (store, tiers and compress never do).

Data flows one way through it::

    cli      options checked before any model loads
     -> sweep     which configurations (caches.CacheSpec), checked up front
     -> data / ruler   tasks: text windows and the recall probe / RULER's own samples
     -> runner    one shared prefill per sample, then a run per configuration (caches.Run)
     -> sweep.summarise   rows: metrics with 95% bootstrap intervals, paired differences
     -> report    table, JSON, plot
"""
