"""Plain English prose for teacher-forced accuracy checks: about 2,100 tokens of narrative (SmolLM2's tokenizer),
written for this project (no copyright; free to use as the public domain). A model's next-token predictions over
real sentences say more about a numerics change than random token ids, whose logits are near uniform."""

PARAGRAPHS = (
    "The town stood where the river bent twice before it reached the sea, and for as long as anyone could "
    "remember its people had lived by the water. In the mornings the fishing boats went out before the sun was "
    "up, their lamps moving slowly across the harbour like a second set of stars, and in the evenings they came "
    "back heavy and low in the water, followed by a crowd of gulls that cried and wheeled above the masts. The "
    "houses along the quay were narrow and tall, painted in colours that had faded long ago into soft greys and "
    "blues, and their windows looked out over the boats as if the houses themselves were waiting for news.",

    "Martha Hale had kept the bakery on the corner of Mill Street for thirty years. She rose each day at four, lit "
    "the great iron oven that her father had built, and began the slow work of the dough while the rest of the "
    "town was still asleep. She did not mind the early hours. There was a kind of peace in the dark kitchen, with "
    "the fire ticking in the oven and the flour settling on every surface like a light fall of snow. By the time "
    "the first customers came to the door, the shelves were full of loaves, rolls and small sweet cakes, and the "
    "smell of warm bread drifted down the street and out across the water.",

    "Her nephew Thomas had come to live with her in the spring, after his mother fell ill and could no longer look "
    "after him. He was twelve years old, thin and quiet, and at first he said very little. He watched everything "
    "with serious grey eyes: the way Martha folded the dough over itself and pressed it down with the heel of her "
    "hand, the way she tested the heat of the oven by holding her palm near the open door, the way she counted "
    "the coins at the end of the day and wrote the numbers in a small black book. After a few weeks he began to "
    "help. He carried sacks of flour from the cellar, swept the floor, and learned to shape the rolls so that they "
    "rose evenly and did not split.",

    "One morning in early summer a stranger arrived on the coach from the city. He was a tall man in a dark coat, "
    "with a leather case under his arm and a hat pulled low over his eyes. He took a room at the inn by the "
    "harbour and spent the first day walking along the quay, stopping now and then to look at the boats or to "
    "write something in a notebook. People noticed him, as people in small towns always notice strangers, and by "
    "evening everyone had an opinion about who he was and why he had come. Some said he was a buyer for one of the "
    "big fish markets. Others said he was a government man, sent to measure the harbour for a new wall. The "
    "children decided that he was a spy, though none of them could say for whom.",

    "He came into the bakery on the third day, just as Martha was taking the last trays out of the oven. He bought "
    "a loaf of brown bread and two of the honey cakes, and while she wrapped them he asked, politely, how long she "
    "had been baking in the town. She told him. He asked whether the oven was old, and she told him about her "
    "father, who had built it with his own hands from bricks he had carried up from the beach. The stranger "
    "listened carefully, nodding, and when she had finished he thanked her and said that it was the best bread he "
    "had eaten in many years. Then he put on his hat and went out, and Thomas, who had been watching from behind "
    "the counter, asked his aunt what the man had wanted.",

    "\"I think he only wanted bread,\" Martha said, but she did not sound certain, and for the rest of the day she "
    "was quieter than usual.",

    "The truth came out a week later, at a meeting in the old hall behind the church. The stranger stood at the "
    "front of the room and explained, in a calm and careful voice, that he worked for a company that planned to "
    "build a railway along the coast. The line would come down from the hills, cross the river on a new bridge, "
    "and end at a station on the flat ground beside the harbour. Trains would carry fish to the city in a few "
    "hours instead of two days, and they would bring visitors from the city to the sea. There would be work for "
    "many people while the line was built, he said, and afterwards there would be trade of a kind the town had "
    "never known.",

    "The room was silent for a moment when he finished, and then everyone began to talk at once. The fishermen "
    "were pleased, because fresh fish sold for more than salted fish, and the innkeeper was delighted at the "
    "thought of guests. But there were others who were not pleased at all. The flat ground beside the harbour was "
    "where the market was held every Saturday, and where the children played in the long summer evenings, and "
    "where, a hundred years before, the people of the town had gathered to watch for the boats that did not come "
    "back from the great storm. To build a station there, they said, would be to build over something that "
    "belonged to everyone.",

    "Martha said nothing at the meeting. She walked home slowly with Thomas beside her, and when they reached the "
    "bakery she sat down at the kitchen table without lighting the lamp. Thomas made tea, the way she had taught "
    "him, and set the cup in front of her. After a while she began to speak. She told him about her father, who "
    "had come to the town as a young man with nothing but a set of tools and a letter of introduction to the old "
    "miller. She told him about the years when the harvest failed and the mill stood idle, and about the winter "
    "when the river froze so hard that people walked across it to the other bank. She told him about the storm, "
    "which her grandmother had seen, and about the names carved on the stone by the harbour wall.",

    "\"Things change,\" she said at last. \"That is not a bad thing in itself. But a town is like a loaf of bread. "
    "If you put it in the oven too hot, the outside burns before the inside is done, and you cannot make it right "
    "again afterwards. You have to give it time.\"",

    "Thomas thought about this for a long while. The next morning, when they had finished the first batch of "
    "loaves, he asked whether he could go down to the inn and speak to the stranger. Martha looked at him in "
    "surprise, and then she smiled, for the first time in several days, and told him to take a honey cake with "
    "him, because it was rude to visit a man empty-handed.",

    "The stranger was sitting by the window of the inn with his notebook open in front of him. He looked up when "
    "Thomas came in and seemed glad of the company. Thomas gave him the cake and, after a moment of nervous "
    "silence, asked him whether the station had to be built on the flat ground by the harbour, or whether it "
    "could be built somewhere else. The stranger did not laugh at the question. He opened his leather case and "
    "took out a large map of the coast, which he spread across the table, and together they looked at the river, "
    "the hills, the road to the city and the narrow streets of the town.",

    "They talked for most of the morning. The stranger explained why the engineers had chosen the harbour: the "
    "ground there was level and firm, and the boats could unload straight into the waiting wagons. Thomas "
    "listened, and then he pointed to a place on the map just beyond the old mill, where the river widened and "
    "the bank sloped gently down to the water. The ground there was level too, he said, and it belonged to nobody, "
    "because it flooded in the spring and no one could farm it. If the bank were raised a little, the flood would "
    "not reach it, and the boats could come up the river as far as the mill on the evening tide.",

    "The stranger studied the map for a long time without speaking. Then he folded it carefully, put it back in "
    "his case, and said that he would need to walk along the river and see the place for himself. He asked "
    "Thomas to show him the way.",

    "It took the company another year to make up its mind, and another two years to build the line. In the end the "
    "station was built beside the old mill, on a bank of earth and stone that the workmen raised above the reach "
    "of the spring floods. The boats came up the river on the evening tide and unloaded their catch straight into "
    "the waiting wagons, just as Thomas had said they would. The flat ground by the harbour stayed as it had "
    "always been, and on Saturdays the market was held there, and in the long summer evenings the children played "
    "there until it was too dark to see the ball.",

    "The railway brought visitors, as the stranger had promised, and many of them found their way to the bakery on "
    "the corner of Mill Street. Martha baked more bread than she ever had before, and Thomas, who was taller now "
    "and no longer quiet, learned to light the great iron oven by himself and to tell by the sound of a loaf, when "
    "he tapped it underneath, whether it was done. On the wall behind the counter there hung a small framed letter "
    "from the railway company, thanking a certain young man for his help in choosing the site of the station. "
    "Visitors sometimes asked about it, and Martha always told them the story, though she told it a little "
    "differently each time, and in every version the honey cake grew a little larger.",

    "Years later, when Thomas was a grown man with children of his own, he would sometimes walk down to the "
    "harbour in the early morning and watch the boats go out. The lamps still moved across the water like a "
    "second set of stars, and the gulls still cried and wheeled above the masts, and the narrow houses along the "
    "quay still looked out over the water as if they were waiting for news. Behind him, on the corner of Mill "
    "Street, the windows of the bakery glowed with a warm yellow light, and the smell of bread drifted down the "
    "street and out across the sea, just as it had on the morning he first arrived.",
)

TEXT = "\n\n".join(PARAGRAPHS)
