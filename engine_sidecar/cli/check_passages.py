"""The passages and questions `ragcache check` probes fidelity with: short encyclopaedic facts, so
any instruction model answers from them in a few tokens."""

PASSAGES = [
    "The Danube is Europe's second-longest river. It rises in the Black Forest in Germany and flows "
    "for 2,850 kilometres through ten countries, including Austria, Hungary and Romania, before "
    "reaching the Black Sea through a wide delta.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa at 5,895 metres. It is a dormant "
    "volcano with three cones, Kibo, Mawenzi and Shira, and its glaciers have shrunk by more than 80 "
    "percent since 1912.",
    "Marie Curie was a Polish-born physicist and chemist who worked in Paris. She was the first woman "
    "to win a Nobel Prize, and the only person to win Nobel Prizes in two sciences, physics in 1903 and "
    "chemistry in 1911.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia. Stretching for over 2,300 "
    "kilometres, it is the world's largest coral reef system and can be seen from outer space.",
    "Johannes Gutenberg introduced printing with movable metal type in Mainz around 1440. His Bible, "
    "printed in the 1450s, was the first major book produced this way in Europe.",
]

QUESTIONS = [
    "Into which sea does the Danube flow?",
    "How high is Mount Kilimanjaro?",
    "In which two sciences did Marie Curie win Nobel Prizes?",
    "Off which Australian state does the Great Barrier Reef lie?",
    "In which city did Gutenberg print with movable type?",
    "How many countries does the Danube flow through?",
]
