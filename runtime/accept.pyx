# placeholder: built in the tree issue
