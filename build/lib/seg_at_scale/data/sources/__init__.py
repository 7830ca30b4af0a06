"""Dataset sources, one module each, one shape (:class:`~seg_at_scale.data.sources.base.Source`).

=========================  ==========================================  =================
module                     source                                       ``data=``
=========================  ==========================================  =================
:mod:`.synthetic`          synthetic satellite scenes (the demo)        ``synthetic``
:mod:`.streets`            synthetic street views (Gated-SCNN)          ``streets``
:mod:`.cosmic`             synthetic CosmicTagger events; larcv3 files  ``cosmic``,
                                                                        ``cosmic_h5``
:mod:`.cityscapes`         Cityscapes (``leftImg8bit/`` + ``gtFine/``)  ``cityscapes``
:mod:`.taco`               TACO (COCO polygons)                         ``taco``
:mod:`.tiff`               your own TIFF scenes                         ``tiff``
=========================  ==========================================  =================

The data config names its source in ``data.synthetic.generator``; the training command
builds it before anything else (:func:`seg_at_scale.cli.data_setup.make_synthetic`).
"""
